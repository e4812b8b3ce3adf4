"""`python -m transformer_engine_proto.precision --out h100.json`: measure a cost table (calibrate.py)."""
from .calibrate import main

main()
