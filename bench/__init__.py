"""`make bench`: Ragline's chat acceptance latency next to a plain synchronous FastAPI app and the bare
Temporal start_workflow floor (see bench/run.py)."""
