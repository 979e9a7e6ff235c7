"""Heartbeats for activities that wait on something slow (a model call, another job's result).

Temporal tells a running activity that its job was cancelled (or has ended) only in the answer to a
heartbeat. An activity that waits on a model without heartbeating keeps the model generating for a
job nobody waits for any more; one that heartbeats stops within `[heartbeats] every` of the policy
file: its task is cancelled, which closes the model call's connection."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from temporalio import activity

from temporal import policies


@contextlib.asynccontextmanager
async def heartbeating(details: Callable[[], Any] | None = None) -> AsyncIterator[None]:
    """Heartbeat while the block runs. The first beat comes after one interval, so a short call sends
    none; the worker throttles beats to the same interval. An activity that keeps its progress in its
    heartbeat details passes `details`: every beat replaces them."""
    every = policies.heartbeat_every().total_seconds()

    async def beat() -> None:
        while True:
            await asyncio.sleep(every)
            activity.heartbeat(*([details()] if details is not None else []))

    beats = asyncio.create_task(beat())
    try:
        yield
    finally:
        beats.cancel()
