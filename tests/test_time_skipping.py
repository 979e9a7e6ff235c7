"""Long waits, skipped: the dead-letter TTL and the review timeout on the time-skipping test server."""

from __future__ import annotations

import concurrent.futures
import shutil
import sys
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from ragline.blobstore import BlobStore
from ragline.settings import Settings
from ragline.vectorstore import ChunkPoint, open_index
from temporal import policies
from temporal.converter import build_data_converter
from tests.conftest import FIXTURES
from worker import build_worker
from workflows.agent import AgentWorkflow
from workflows.chat import ChatTurnWorkflow
from workflows.models import AgentInput, TurnContext, TurnInput


@asynccontextmanager
async def time_skipping_worker(scripted_llm, tmp_path, **overrides):
    binary = str(Path(sys.executable).parent / "temporal-test-server")
    if not Path(binary).exists():
        binary = shutil.which("temporal-test-server")
    settings = Settings(data_dir=tmp_path, task_queue="skip", llm_base_url=scripted_llm.base_url,
                        llm_model="scripted", llm_timeout=3, policies=FIXTURES.parent / "fast_policies.toml",
                        **overrides)
    # The environment's own client is the one that lets the server skip time while we wait.
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=binary, data_converter=build_data_converter(BlobStore(settings.blob_dir)))
    index = open_index(settings)
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as executor:
            async with build_worker(env.client, settings, index, executor):
                yield env.client, index
    finally:
        index.close()
        await env.shutdown()
        policies.load(FIXTURES.parent / "fast_policies.toml")  # overrides are process-wide


async def test_untouched_dead_letter_fails_after_ttl(scripted_llm, tmp_path):
    scripted_llm.script("summarize", ["503"] * 50)
    try:
        async with time_skipping_worker(scripted_llm, tmp_path, dead_letter_ttl="3d") as (client, index):
            # One indexed passage so the chain calls the model; summarizing then fails on every attempt.
            index.upsert("ttl", [ChunkPoint(document_id="d1", chunk_index=0, vector=[1.0] + [0.0] * 383,
                                            payload={"document_id": "d1", "filename": "f.txt", "page": 1,
                                                     "chunk": 0, "text": "The sky is blue."})])
            handle = await client.start_workflow(
                ChatTurnWorkflow.run, TurnInput(session_id="s", turn=1, message="What colour is the sky?",
                                                collection="ttl", top_k=1),
                id=f"ttl-{uuid.uuid4().hex[:6]}", task_queue="skip")
            await handle.signal(ChatTurnWorkflow.proceed, TurnContext())
            with pytest.raises(WorkflowFailureError) as failure:
                await handle.result()
    finally:
        scripted_llm.clear_script("summarize")
    assert failure.value.cause.type == "DeadLetterExpired"
    assert "3d" in failure.value.cause.message and "summarize_context" in failure.value.cause.message


async def test_unanswered_review_is_rejected_after_the_timeout(scripted_llm, tmp_path):
    scripted_llm.script("agent", [{"tool_calls": [{"name": "delegate", "arguments": {"subgoal": "a part"}}]}])
    try:
        async with time_skipping_worker(scripted_llm, tmp_path) as (client, _):
            result = await client.execute_workflow(
                AgentWorkflow.run, AgentInput(goal="Survey the coast", max_depth=0, review_timeout_seconds=86400),
                id=f"review-timeout-{uuid.uuid4().hex[:6]}", task_queue="skip")
    finally:
        scripted_llm.clear_script("agent")
    assert result.status == "stopped"
    [decision] = result.decisions
    assert decision["comment"] == "review timed out" and decision["decision"] == "reject"
    assert decision["reviewer"] == "system" and decision["reason"] == "depth"
