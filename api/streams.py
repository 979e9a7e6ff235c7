"""One subscription per job and API process, shared by every SSE client that follows the job.

Each poll of a job's stream is an Update that waits in the job's workflow, and Temporal admits only a
few Updates in flight per workflow (10 by default). Were every open tab to poll on its own, the
eleventh would be refused, and so would a reviewer's decision or an operator's retry (Updates too).
Here the first client of a job starts its subscription and the others read what it has received."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

from temporalio.client import Client
from temporalio.contrib.workflow_streams import WorkflowStreamClient

from models.jobs import EVENTS_TOPIC


class _Shared:
    """A job's events from offset 0 as they arrive, for any number of readers."""

    def __init__(self, client: Client, job_id: str, cooldown: timedelta) -> None:
        self.items: list[Any] = []  # WorkflowStreamItem, by offset (the topic's offsets are contiguous from 0)
        self.ended = False
        self.error: BaseException | None = None
        self.readers = 0
        self._arrived = asyncio.Condition()
        self._task = asyncio.create_task(self._pump(client, job_id, cooldown))

    async def _pump(self, client: Client, job_id: str, cooldown: timedelta) -> None:
        try:
            async for item in WorkflowStreamClient.create(client, job_id).subscribe(
                    EVENTS_TOPIC, from_offset=0, poll_cooldown=cooldown):
                async with self._arrived:
                    self.items.append(item)
                    self._arrived.notify_all()
        except Exception as exc:  # noqa: BLE001 - every reader gets it
            self.error = exc
        finally:
            async with self._arrived:
                self.ended = True
                self._arrived.notify_all()

    async def read(self, start: int) -> AsyncIterator[Any]:
        position = 0
        while True:
            async with self._arrived:
                await self._arrived.wait_for(lambda: len(self.items) > position or self.ended)
                fresh, position = self.items[position:], len(self.items)
            for item in fresh:
                if item.offset >= start:
                    yield item
            if self.ended and position == len(self.items):
                if self.error is not None:
                    raise self.error
                return

    def stop(self) -> None:
        self._task.cancel()


class JobStreams:
    """The shared subscriptions of one API process (app.state.streams), and the streams each key holds open."""

    def __init__(self, max_per_key: int = 100) -> None:
        self._by_job: dict[str, _Shared] = {}
        self.max_per_key = max_per_key
        self._open: Counter[str] = Counter()

    def full_for(self, key: str) -> bool:
        """Whether the key (its sha256) holds as many streams open as it may."""
        return self._open[key] >= self.max_per_key

    async def held_open(self, key: str, stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """`stream`, counted against the key's open streams until it ends or its client goes."""
        self._open[key] += 1
        try:
            async for item in stream:
                yield item
        finally:
            self._open[key] -= 1
            if not self._open[key]:
                del self._open[key]

    async def follow(self, client: Client, job_id: str, start: int, cooldown: timedelta) -> AsyncIterator[Any]:
        """The job's events from offset `start` on; ends after the stream does."""
        shared = self._by_job.get(job_id)
        if shared is None or (shared.ended and shared.error is not None):
            shared = self._by_job[job_id] = _Shared(client, job_id, cooldown)
        shared.readers += 1
        try:
            async for item in shared.read(start):
                yield item
        finally:
            shared.readers -= 1
            if shared.readers == 0 and self._by_job.get(job_id) is shared:
                shared.stop()
                del self._by_job[job_id]
