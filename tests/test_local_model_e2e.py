"""End to end with the real local model (llama.cpp + Qwen2.5-Coder-0.5B, the `make run` default):
ingest a short document, ask a question whose answer is in it, get an answer that cites it."""

from __future__ import annotations

import pytest

from tests.conftest import running_stack
from tests.local_llm import local_llm_unavailable, model_dir, start_local_llm

DOCUMENT = ("Brightwater Lighthouse stands on the northern cape of the island of Vell. "
            "Its keeper is Marta Quill, who has kept the light burning since 1987. "
            "The lamp is lit every evening at dusk and can be seen from 30 kilometres away.")


async def test_real_local_model_answers_from_an_ingested_document(temporal_env, scripted_llm, tmp_path):
    reason = local_llm_unavailable()
    if reason:
        pytest.fail(f"`make test` installs the local model; {reason}")
    base_url, stop = start_local_llm(model_dir())
    try:
        address = temporal_env.client.service_client.config.target_host
        async with running_stack(address, scripted_llm, tmp_path, task_queue="ragline-local-llm",
                                 llm_base_url=base_url, llm_model="local", llm_timeout=240,
                                 llm_max_tokens=96) as stack:
            body = await stack.upload(("lighthouse.txt", DOCUMENT.encode()), collection="e2e")
            assert (await stack.wait_job(body["job_id"]))["status"] == "completed"
            accepted = await stack.chat("Who is the keeper of Brightwater Lighthouse?", collection="e2e")
            job = await stack.wait_job(accepted["job_id"], timeout=600)
    finally:
        stop()
    assert job["status"] == "completed", job
    result = job["result"]
    assert result["answer"].strip()
    assert result["citations"], f"the answer cites nothing: {result['answer']!r}"
    assert result["citations"][0]["document_id"] == body["documents"][0]["document_id"]
    assert result["model"] and result["usage"]["completion_tokens"] > 0
