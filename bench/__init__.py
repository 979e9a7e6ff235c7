"""`make bench`: Ragline's chat acceptance latency next to a plain synchronous FastAPI app and the bare
Temporal start_workflow floor, then Ragline against its floors (in-order acceptance, first answer delta,
a burst of chats, the orchestration's own cost) and completion under injected faults (see bench/run.py)."""
