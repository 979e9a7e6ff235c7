"""The data converter's claim check: a payload over `LARGE_PAYLOAD_BYTES` travels as a reference into the
blob store (encrypted like any payload), so an unexpectedly large activity result or workflow input never
lands in a workflow history, and comes back whole wherever it is read."""

from __future__ import annotations

import uuid
from datetime import timedelta
from types import SimpleNamespace

from temporalio import activity, workflow
from temporalio.api.failure.v1 import Failure
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from temporal.converter import LARGE_PAYLOAD_BYTES, build_data_converter

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


async def test_a_failure_message_travels_encrypted_and_reads_back_as_recorded(tmp_path):
    """With payload encryption a failure's message and stack trace go into its encoded attributes, which the
    codec encrypts; `failure_message` reads them back, and a failure recorded before (plain message) as it is."""
    # Imported here: the sandbox re-imports this module for BigRoundTrip, and these modules are not for it.
    from api.job_views import failure_message
    from ragline.settings import Settings

    converter = build_data_converter(Settings(data_dir=tmp_path))
    client = SimpleNamespace(data_converter=converter)  # all failure_message needs of a client
    failure = Failure()
    await converter.encode_failure(ApplicationError("discarded by bo: the vault figures", type="Discarded"), failure)
    assert failure.message == "Encoded failure" and not failure.stack_trace
    assert b"vault" not in failure.SerializeToString()
    assert await failure_message(client, failure) == "discarded by bo: the vault figures"
    assert failure.message == "Encoded failure"  # the caller's proto is left as Temporal keeps it
    # An Update validator's refusal is never stored; the Web UI's Send an Update dialog shows it undecoded.
    refusal = Failure()
    await converter.encode_failure(ApplicationError("reviewer is required", type="InvalidReview"), refusal)
    assert refusal.message == "reviewer is required" and not refusal.HasField("encoded_attributes")
    recorded_before = Failure(message="too many pages: 3 > 2", stack_trace="  File ...")
    assert await failure_message(client, recorded_before) == "too many pages: 3 > 2"
    # Without encryption the message stays plain, as before.
    plain = build_data_converter(Settings(data_dir=tmp_path, encrypt_payloads=False))
    unencrypted = Failure()
    await plain.encode_failure(ApplicationError("no extractable text"), unencrypted)
    assert unencrypted.message == "no extractable text" and not unencrypted.HasField("encoded_attributes")
