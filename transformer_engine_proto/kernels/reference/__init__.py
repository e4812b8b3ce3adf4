"""Pure-torch reference kernels: the executable spec of every format (DESIGN.md, format facts)."""
