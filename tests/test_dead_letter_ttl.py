"""A parked job that nobody touches ends as failed after the dead-letter TTL (time-skipping server)."""

from __future__ import annotations

import concurrent.futures
import shutil
import sys
import uuid
from pathlib import Path

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from ragline.settings import Settings
from ragline.vectorstore import ChunkPoint, open_index
from ragline.blobstore import BlobStore
from temporal.converter import build_data_converter
from tests.conftest import FIXTURES
from temporal import policies
from worker import build_worker
from workflows.chat import ChatTurnWorkflow
from workflows.models import TurnContext, TurnInput


async def test_untouched_dead_letter_fails_after_ttl(scripted_llm, tmp_path):
    binary = str(Path(sys.executable).parent / "temporal-test-server")
    if not Path(binary).exists():
        binary = shutil.which("temporal-test-server")
    settings = Settings(data_dir=tmp_path, task_queue="ttl", llm_base_url=scripted_llm.base_url,
                        llm_model="scripted", llm_timeout=3, policies=FIXTURES.parent / "fast_policies.toml",
                        dead_letter_ttl="3d")
    # The environment's own client is the one that lets the server skip time while we wait.
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=binary, data_converter=build_data_converter(BlobStore(settings.blob_dir)))
    try:
        client = env.client
        index = open_index(settings)
        # One indexed passage so the chain calls the model; summarizing then fails on every attempt.
        index.upsert("ttl", [ChunkPoint(document_id="d1", chunk_index=0, vector=[1.0] + [0.0] * 383,
                                        payload={"document_id": "d1", "filename": "f.txt", "page": 1,
                                                 "chunk": 0, "text": "The sky is blue."})])
        scripted_llm.script("summarize", ["503"] * 50)
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as executor:
            worker = build_worker(client, settings, index, executor)
            async with worker:
                handle = await client.start_workflow(
                    ChatTurnWorkflow.run, TurnInput(session_id="s", turn=1, message="What colour is the sky?",
                                                    collection="ttl", top_k=1),
                    id=f"ttl-{uuid.uuid4().hex[:6]}", task_queue="ttl")
                await handle.signal(ChatTurnWorkflow.proceed, TurnContext())
                with pytest.raises(WorkflowFailureError) as failure:
                    await handle.result()
        assert failure.value.cause.type == "DeadLetterExpired"
        assert "3d" in failure.value.cause.message and "summarize_context" in failure.value.cause.message
        index.close()
    finally:
        scripted_llm.clear_script("summarize")
        await env.shutdown()
        policies.load(FIXTURES.parent / "fast_policies.toml")  # the TTL override is process-wide
