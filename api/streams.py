"""One subscription per job and API process, shared by every SSE client that follows the job.

Each poll of a job's stream is an Update that waits in the job's workflow, and Temporal admits only a
few Updates in flight per workflow (10 by default). Were every open tab to poll on its own, the
eleventh would be refused, and so would a reviewer's decision or an operator's retry (Updates too).
Here the first client of a job starts its subscription and the others read what it has received."""

from __future__ import annotations

import asyncio
import base64
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from datetime import timedelta
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.types import Receive, Scope, Send
from temporalio.api.common.v1 import Payload
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowUpdateFailedError
from temporalio.contrib.workflow_streams import PollInput, PollResult, WorkflowStreamClient, WorkflowStreamItem

from models.jobs import EVENTS_TOPIC
from workflows.events import POLL_UPDATE, POLLS_SPENT

# Reading a stream by query (once its job has answered all the polls it takes): this often at most.
QUERY_EVERY = timedelta(seconds=1)


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
            try:
                async for item in WorkflowStreamClient.create(client, job_id).subscribe(
                        EVENTS_TOPIC, from_offset=len(self.items), poll_cooldown=cooldown):
                    await self._add(item)
            except WorkflowUpdateFailedError as exc:
                if getattr(exc.cause, "type", None) != POLLS_SPENT:
                    raise
                await self._by_query(client, job_id, max(cooldown, QUERY_EVERY))
        except Exception as exc:  # noqa: BLE001 - every reader gets it
            self.error = exc
        finally:
            async with self._arrived:
                self.ended = True
                self._arrived.notify_all()

    async def _add(self, item: WorkflowStreamItem) -> None:
        async with self._arrived:
            self.items.append(item)
            self._arrived.notify_all()

    async def _by_query(self, client: Client, job_id: str, every: timedelta) -> None:
        """The rest of the stream read by query (no Update: the job keeps its last ones for decisions), every
        `every` while the job runs; to the end once it has ended."""
        # Pinned to the run that refused the poll (the latest a moment ago): a later run of the id (a document
        # uploaded again) is not read after it.
        run_id = (await client.get_workflow_handle(job_id).describe()).run_id
        handle = client.get_workflow_handle(job_id, run_id=run_id)
        converter = client.data_converter.payload_converter
        ended = False
        while True:
            result: PollResult = await handle.query(POLL_UPDATE, PollInput(topics=[EVENTS_TOPIC],
                                                                          from_offset=len(self.items)),
                                                    result_type=PollResult)
            for wire in result.items:
                payload = Payload.FromString(base64.b64decode(wire.data))
                await self._add(WorkflowStreamItem(topic=wire.topic, data=converter.from_payload(payload),
                                                   offset=wire.offset))
            if result.more_ready:
                continue
            if ended:
                return
            await asyncio.sleep(every.total_seconds())
            ended = (await handle.describe()).status != WorkflowExecutionStatus.RUNNING  # then one more read

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


class StreamSlot:
    """One open stream of a key, from the request's check until its response ends. A route holds it with
    `with slot:`, which gives it back unless a response took it over (`handed_on`); released once."""

    def __init__(self, give_back: Callable[[], None]) -> None:
        self._give_back: Callable[[], None] | None = give_back
        self.handed_on = False

    def release(self) -> None:
        give_back, self._give_back = self._give_back, None
        if give_back is not None:
            give_back()

    def __enter__(self) -> StreamSlot:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.handed_on:
            self.release()


class HeldEventSource(EventSourceResponse):
    """An event stream that holds its key's slot until the response ends, however it ends (the client goes,
    the stream ends, a HEAD request never iterates it); the stream is closed then, not when it is collected."""

    def __init__(self, stream: AsyncIterator[Any], slot: StreamSlot, **kwargs: Any) -> None:
        super().__init__(_closed_after(stream), **kwargs)
        slot.handed_on = True
        self._slot = slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._slot.release()


async def _closed_after(stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`stream`'s items; it is closed when this is (its cleanup, a relay's unsubscribing, runs at once)."""
    async with aclosing(stream):
        async for item in stream:
            yield item


class JobStreams:
    """The shared subscriptions of one API process (app.state.streams), and the streams each key holds open."""

    def __init__(self, max_per_key: int = 100) -> None:
        self._by_job: dict[str, _Shared] = {}
        self.max_per_key = max_per_key
        self._open: Counter[str] = Counter()

    def reserve(self, key: str) -> StreamSlot | None:
        """One of the open streams the key (its sha256) may hold, taken at once so that a burst of opens
        cannot pass the bound; None when it holds them all. The slot is given back by its release."""
        if self._open[key] >= self.max_per_key:
            return None
        self._open[key] += 1
        return StreamSlot(lambda: self._give_back(key))

    def _give_back(self, key: str) -> None:
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
