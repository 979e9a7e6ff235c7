"""Task queue names and worker roles.

Workflows and I/O-bound activities share RAGLINE_TASK_QUEUE ("main"); the policy file puts each
activity on a queue kind, and each kind has its own worker with its own slot count:
"cpu" (extraction, chunking, embedding: a few at a time), "llm" (model calls, bounded per model
endpoint by RAGLINE_LLM_CONCURRENCY, so a small local server is never flooded) and "vector" (the
activities that open the vector store; with the embedded store, only the process that owns it
polls this queue; SearchWorkflow also runs there, so that a search stays one local activity).

A worker process runs one role (`python worker.py --role ROLE`), which polls the queues of ROLES[ROLE].
"""

from __future__ import annotations

from typing import Literal, get_args

QueueKind = Literal["main", "cpu", "llm", "vector"]
QUEUE_KINDS: tuple[str, ...] = get_args(QueueKind)

Role = Literal["all", "workflows", "cpu", "llm", "vector"]
# The queue kinds each role polls. "all" is the single process of `make run` (the default).
ROLES: dict[str, tuple[str, ...]] = {
    "all": QUEUE_KINDS,
    "workflows": ("main",),
    "cpu": ("cpu",),
    "llm": ("llm",),
    "vector": ("vector",),
}
# Queue kinds whose workers also run workflows: main (every job) and vector (SearchWorkflow only).
WORKFLOW_KINDS: tuple[str, ...] = ("main", "vector")


def queue_name(task_queue: str, kind: str) -> str:
    return task_queue if kind == "main" else f"{task_queue}-{kind}"


def cpu_queue(task_queue: str) -> str:
    return queue_name(task_queue, "cpu")


def search_queue(task_queue: str) -> str:
    """Where the API starts SearchWorkflow: the vector role's queue (its worker holds the store)."""
    return queue_name(task_queue, "vector")


def role_queues(task_queue: str, role: str) -> list[str]:
    return [queue_name(task_queue, kind) for kind in ROLES[role]]


def parse_workers(spec: str) -> list[tuple[str, int]]:
    """RAGLINE_WORKERS, e.g. "workflows:1,cpu:1,llm:2,vector:1", as [(role, processes), ...]."""
    out: list[tuple[str, int]] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        role, _, count = part.partition(":")
        role = role.strip()
        if role not in ROLES:
            raise ValueError(f"RAGLINE_WORKERS: unknown role {role!r} (roles: {', '.join(ROLES)})")
        try:
            n = int(count) if count.strip() else 1
        except ValueError:
            raise ValueError(f"RAGLINE_WORKERS: {part!r}: the count must be a whole number") from None
        if n < 0:
            raise ValueError(f"RAGLINE_WORKERS: {part!r}: the count must be >= 0")
        if any(r == role for r, _ in out):
            raise ValueError(f"RAGLINE_WORKERS: role {role!r} given twice")
        if n:
            out.append((role, n))
    if not out:
        raise ValueError("RAGLINE_WORKERS: no worker process at all")
    return out


def check_topology(workers: list[tuple[str, int]], *, embedded_store: bool) -> None:
    """Every queue kind is polled by some process; with the embedded store exactly one process owns it."""
    polled = {kind for role, _ in workers for kind in ROLES[role]}
    missing = [k for k in QUEUE_KINDS if k not in polled]
    if missing:
        raise ValueError(f"RAGLINE_WORKERS: no process polls the {', '.join(missing)} queue(s); "
                         f"add a role for them (roles: {', '.join(ROLES)})")
    if embedded_store:
        owners = sum(n for role, n in workers if "vector" in ROLES[role])
        if owners > 1:
            raise ValueError(
                "RAGLINE_WORKERS: the embedded Qdrant store can be opened by one process only, but "
                f"{owners} processes would run the vector queue (roles vector/all); use one, or set "
                "RAGLINE_QDRANT_URL to a Qdrant server")
