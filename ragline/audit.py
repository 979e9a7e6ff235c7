"""The audit log: who decided each review, cancelled a job or operated a dead-lettered one through the API.

One JSON object per line, appended to RAGLINE_AUDIT_LOG: a file (default <data_dir>/audit.log), or `-`
for standard output, where the platform's log pipeline collects it (the API's own log goes to stderr).
Outside stdout mode the same event also goes to the API log. Decisions sent straight to Temporal
(Web UI, CLI) are recorded by the job itself (`decisions` / `operator_decisions` in its view, and its
history), not here.

On a cluster each API pod appends to a file of its own on a shared volume (deploy/k8s/api.yaml): the
trail outlives the pods and holds every replica's entries, and no two pods append to one file over a
network filesystem, where appends from two clients are not atomic.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import structlog

from ragline.settings import Settings

log = structlog.get_logger("ragline.audit")
_lock = threading.Lock()


def record(settings: Settings, *, action: str, tenant: str, key: str, key_name: str, job_id: str,
           outcome: str, **details: Any) -> dict:
    entry = {"at": datetime.now(timezone.utc).isoformat(), "action": action, "tenant": tenant, "key": key,
             "key_name": key_name, "job_id": job_id, "outcome": outcome,
             **{k: v for k, v in details.items() if v is not None}}
    line = json.dumps(entry, ensure_ascii=False) + "\n"
    path = settings.audit_log_file
    with _lock:
        if path is None:
            # The line is the record: written whatever RAGLINE_LOG_LEVEL is, and not logged a second time.
            sys.stdout.write(line)
            sys.stdout.flush()
            return entry
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(line)
    log.info("audit", **entry)
    return entry


@contextlib.contextmanager
def recorded(settings: Settings, **details: Any) -> Iterator[dict[str, Any]]:
    """Record the action the block takes once it is done: `accepted`; `refused: <error code>` when the block
    raises a client's error (4xx: nothing was done); `unknown: <error>` for any other failure, which may
    come after Temporal applied the action (its answer could not be read, it timed out). The block may add to
    the details it is given (what the action touched)."""
    try:
        yield details
    except Exception as exc:
        code = getattr(exc, "code", type(exc).__name__)
        # An HTTP 4xx of the API's own (ApiError.status, a plain int); an RPCError's status is a gRPC code,
        # an IntEnum of small numbers that says nothing of whether Temporal applied the request.
        status = getattr(exc, "status", None)
        refused = type(status) is int and status < 500
        record(settings, outcome=f"{'refused' if refused else 'unknown'}: {code}", **details)
        raise
    record(settings, outcome="accepted", **details)


def read(settings: Settings) -> list[dict]:
    path = settings.audit_log_file
    if path is None:
        raise ValueError("RAGLINE_AUDIT_LOG is '-': the entries went to standard output")
    if not path.exists():
        return []
    # The part after the last line break is an entry still being written (a reader is not held off by
    # an append in progress): it is read next time.
    complete = path.read_text().split("\n")[:-1]
    return [json.loads(line) for line in complete if line.strip()]
