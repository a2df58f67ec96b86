"""The `batchd` command line: one module per command (click)."""
