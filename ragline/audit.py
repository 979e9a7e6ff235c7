"""The audit log: who decided each review, cancelled a job or operated a dead-lettered one through the API.

One JSON object per line in <data_dir>/audit.log (append-only), and the same event in the API log.
Decisions sent straight to Temporal (Web UI, CLI) are recorded by the job itself (its result's
`decisions` / `operator_decisions`, and its history), not here.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("ragline.audit")
_lock = threading.Lock()


def record(data_dir: Path, *, action: str, tenant: str, key: str, key_name: str, job_id: str,
           outcome: str, **details: Any) -> dict:
    entry = {"at": datetime.now(timezone.utc).isoformat(), "action": action, "tenant": tenant, "key": key,
             "key_name": key_name, "job_id": job_id, "outcome": outcome,
             **{k: v for k, v in details.items() if v is not None}}
    path = Path(data_dir) / "audit.log"
    line = json.dumps(entry, ensure_ascii=False) + "\n"
    with _lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(line)
    log.info("audit", **entry)
    return entry


@contextlib.contextmanager
def recorded(data_dir: Path, **details: Any) -> Iterator[dict[str, Any]]:
    """Record the action the block takes once it is done: `accepted`, or `refused: <error code>` when the
    block raises. The block may add to the details it is given (what the action touched)."""
    try:
        yield details
    except Exception as exc:
        record(data_dir, outcome=f"refused: {getattr(exc, 'code', type(exc).__name__)}", **details)
        raise
    record(data_dir, outcome="accepted", **details)


def read(data_dir: Path) -> list[dict]:
    path = Path(data_dir) / "audit.log"
    if not path.exists():
        return []
    # The part after the last line break is an entry still being written (a reader is not held off by
    # an append in progress): it is read next time.
    complete = path.read_text().split("\n")[:-1]
    return [json.loads(line) for line in complete if line.strip()]
