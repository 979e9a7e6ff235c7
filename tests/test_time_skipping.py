"""Long waits, skipped: the dead-letter TTL and the review timeout on the time-skipping test server."""

from __future__ import annotations

import concurrent.futures
import uuid
from contextlib import asynccontextmanager

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from models.agent import AgentInput
from models.chat import ChatQuestion, TurnContext, TurnInput
from ragline.settings import Settings
from ragline.vectorstore import ChunkPoint, open_index
from temporal.converter import build_data_converter
from tests.conftest import FIXTURES, SERVER_STARTUP
from tests.helpers import time_skipping_server_binary
from worker import activity_threads, build_worker
from workflows.agent import AgentWorkflow
from workflows.chat import ChatTurnWorkflow

# Both tests run their own worker (build_worker loads its policies, with their overrides, process-wide)
# against their own scripted model.
pytestmark = pytest.mark.usefixtures("restore_policies")


@asynccontextmanager
async def time_skipping_worker(llm, tmp_path, **overrides):
    binary = time_skipping_server_binary()
    settings = Settings(data_dir=tmp_path, task_queue="skip", llm_base_url=llm.base_url,
                        llm_model="scripted", llm_timeout=3, policies=FIXTURES.parent / "fast_policies.toml",
                        # a made-up passage: no relevance gate, no answer cache (tests/test_grounded.py has them)
                        relevance_threshold=0.0, answer_cache_size=0, worker_metrics_port=0, **overrides)
    # The environment's own client is the one that lets the server skip time while we wait.
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=binary, data_converter=build_data_converter(settings),
        test_server_startup_timeout=SERVER_STARTUP)
    index = open_index(settings)
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=activity_threads(settings)) as executor:
            async with build_worker(env.client, settings, index, executor):
                yield env.client, index
    finally:
        index.close()
        await env.shutdown()


async def test_untouched_dead_letter_fails_after_ttl(private_llm, tmp_path):
    # Summarizing fails on every attempt (4 in tests/fast_policies.toml), so the step is dead-lettered.
    private_llm.script("summarize", ["503"] * 4)
    async with time_skipping_worker(private_llm, tmp_path, dead_letter_ttl="3d") as (client, index):
        # One indexed passage so the chain calls the model.
        index.upsert("default", "ttl", [ChunkPoint(document_id="d1", chunk_index=0, vector=[1.0] + [0.0] * 383,
                                        payload={"document_id": "d1", "filename": "f.txt", "page": 1,
                                                 "chunk": 0, "text": "The sky is blue."})])
        index.publish("default", "ttl", "d1", chunks=1)
        job_id = f"ttl-{uuid.uuid4().hex[:6]}"
        handle = await client.start_workflow(
            ChatTurnWorkflow.run, TurnInput(job_id=job_id, session_id="s", turn=1, question=ChatQuestion(
                message="What colour is the sky?", collection="ttl", top_k=1)),
            id=job_id, task_queue="skip")
        await handle.signal(ChatTurnWorkflow.proceed, TurnContext())
        with pytest.raises(WorkflowFailureError) as failure:
            await handle.result()
    assert failure.value.cause.type == "DeadLetterExpired"
    assert "3d" in failure.value.cause.message and "summarize_context" in failure.value.cause.message
    assert private_llm.count("summarize") == 4 and private_llm.count("summarize", ok_only=True) == 0


async def test_unanswered_review_is_rejected_after_the_timeout(private_llm, tmp_path):
    private_llm.script("agent", [{"tool_calls": [{"name": "delegate", "arguments": {"subgoal": "a part"}}]}])
    async with time_skipping_worker(private_llm, tmp_path) as (client, _):
        result = await client.execute_workflow(
            AgentWorkflow.run, AgentInput(goal="Survey the coast", max_depth=0, review_timeout_seconds=86400),
            id=f"review-timeout-{uuid.uuid4().hex[:6]}", task_queue="skip")
    assert result.status == "stopped"
    [decision] = result.decisions
    assert decision.comment == "review timed out" and decision.decision == "reject"
    assert decision.reviewer == "system" and decision.reason == "depth"
