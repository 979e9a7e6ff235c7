"""Task queue names. Workflows and I/O-bound activities share RAGLINE_TASK_QUEUE ("main"); the policy
file puts each activity on a queue kind, and each kind has its own worker with its own slot count:
"cpu" (extraction, chunking, embedding: a few at a time) and "llm" (model calls, bounded per model
endpoint by RAGLINE_LLM_CONCURRENCY, so a small local server is never flooded)."""

from __future__ import annotations

from typing import Literal, get_args

QueueKind = Literal["main", "cpu", "llm"]
QUEUE_KINDS: tuple[str, ...] = get_args(QueueKind)


def queue_name(task_queue: str, kind: str) -> str:
    return task_queue if kind == "main" else f"{task_queue}-{kind}"


def cpu_queue(task_queue: str) -> str:
    return queue_name(task_queue, "cpu")
