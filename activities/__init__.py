"""Activities: every piece of I/O a workflow needs, each a small typed function."""
