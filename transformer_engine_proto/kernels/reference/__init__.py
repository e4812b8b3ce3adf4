"""Pure-torch reference kernels: the executable spec of every format (docs/design.md, format facts)."""
