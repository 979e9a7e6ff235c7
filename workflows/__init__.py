"""Workflows: each file reads as the DAG it runs. Deterministic and thin: all I/O is in activities."""
