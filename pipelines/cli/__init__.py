"""The `lmpipe` command line: one module per command group."""
