"""Heartbeats for activities that wait on something slow (a model call, another job's result).

Temporal tells a running activity that its job was cancelled (or has ended) only in the answer to a
heartbeat. An activity that waits on a model without heartbeating keeps the model generating for a
job nobody waits for any more; one that heartbeats stops within `[heartbeats] every` of the policy
file: its task is cancelled, which closes the model call's connection."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import timedelta
from typing import Any

from temporalio import activity

from temporal import policies


@contextlib.asynccontextmanager
async def heartbeating(details: Callable[[], Any] | None = None, *,
                      every: timedelta | None = None) -> AsyncIterator[None]:
    """Heartbeat while the block runs. The first beat comes after one interval, so a short call sends
    none; the worker throttles beats to the same interval. An activity that keeps its progress in its
    heartbeat details passes `details`: every beat replaces them. `every`: another interval than [heartbeats]
    every (a model call on a worker of few model slots: policies.model_call_beat)."""
    every = (every or policies.heartbeat_every()).total_seconds()

    async def beat() -> None:
        while True:
            await asyncio.sleep(every)
            activity.heartbeat(*([details()] if details is not None else []))

    beats = asyncio.create_task(beat())
    try:
        yield
    finally:
        beats.cancel()


@contextlib.contextmanager
def heartbeating_in_thread(*details: Any) -> Iterator[None]:
    """For a sync activity (it runs in a worker thread): heartbeat from a thread of its own while the
    block runs, so that a long CPU step, or a wait for the one embedding engine, is not taken for a dead
    worker. Without it, four batches queued on a busy machine timed out one after another, were
    retried, and timed out again."""
    every = policies.heartbeat_every().total_seconds()
    done = threading.Event()
    context = contextvars.copy_context()  # the activity's: heartbeat() finds it there

    def beat() -> None:
        while not done.wait(every):
            context.run(activity.heartbeat, *details)

    beats = threading.Thread(target=beat, name="heartbeat", daemon=True)
    beats.start()
    try:
        yield
    finally:
        done.set()
        beats.join()
