"""The data converter's claim check: a payload over `LARGE_PAYLOAD_BYTES` travels as a reference into the
blob store (encrypted like any payload), so an unexpectedly large activity result or workflow input never
lands in a workflow history, and comes back whole wherever it is read."""

from __future__ import annotations

import uuid
from datetime import timedelta

from temporalio import activity, workflow
from temporalio.worker import Worker

from temporal.converter import LARGE_PAYLOAD_BYTES

BIG = LARGE_PAYLOAD_BYTES * 2


@activity.defn
async def echo_big(text: str) -> str:
    return text + "!" * BIG


@workflow.defn
class BigRoundTrip:
    @workflow.run
    async def run(self, text: str) -> str:
        echoed = await workflow.execute_activity(echo_big, text, start_to_close_timeout=timedelta(seconds=30))
        return echoed[: len(text) + 1]


async def test_a_payload_over_the_threshold_travels_as_a_blob_reference(stack):
    queue = f"converter-{uuid.uuid4().hex[:8]}"
    big_input = "harbour " * (BIG // 8)  # the workflow's own input is large too
    async with Worker(stack.client, task_queue=queue, workflows=[BigRoundTrip], activities=[echo_big]):
        handle = await stack.client.start_workflow(BigRoundTrip.run, big_input, id=f"big-{queue}", task_queue=queue)
        assert await handle.result() == big_input + "!"
    # The history holds references, not the payloads: every payload in it is far below the threshold.
    sizes = [len(event.SerializeToString()) async for event in handle.fetch_history_events()]
    assert max(sizes) < LARGE_PAYLOAD_BYTES / 4, sizes
