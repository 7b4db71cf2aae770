"""The `b12x` command line: one module per command group."""
