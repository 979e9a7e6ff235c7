"""ragline_model_errors_total counts the calls a model failed, what RaglineModelErrorRate compares with
ragline_model_calls_total: a call stopped by its own side (the job cancelled, a sibling step failed, the
worker stopping) is counted as a call, not as the model's error."""

from __future__ import annotations

import asyncio

import pytest

from ragline import metrics
from ragline.llm import ChatModel
from ragline.settings import Settings
from tests.helpers import eventually

MESSAGES = [{"role": "system", "content": "TASK: answer"}, {"role": "user", "content": "QUESTION: tides?"}]


@pytest.fixture
def recorded(monkeypatch) -> list[dict]:
    calls: list[dict] = []
    monkeypatch.setattr(metrics, "model_call", lambda step, model, seconds, **kw: calls.append(
        {"step": step, "model": model, **kw}))
    return calls


async def _received(llm) -> bool:
    return bool(llm.calls)


def _model(llm, tmp_path) -> ChatModel:
    return ChatModel(Settings(data_dir=tmp_path, llm_base_url=llm.base_url, llm_model="scripted", llm_timeout=5))


async def test_a_call_cancelled_by_its_job_is_no_model_error(private_llm, recorded, tmp_path):
    private_llm.set_delay(3)
    call = asyncio.create_task(_model(private_llm, tmp_path).complete(MESSAGES, step="generate"))
    await eventually(lambda: _received(private_llm), what="the model has the call")  # under way, not yet answered
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert [(c["step"], c.get("error_type")) for c in recorded] == [("generate", None)], recorded


async def test_a_call_the_model_fails_is_counted_with_its_error_type(private_llm, recorded, tmp_path):
    private_llm.script("answer", ["503"])
    with pytest.raises(Exception):
        await _model(private_llm, tmp_path).complete(MESSAGES, step="generate")
    assert [c.get("error_type") for c in recorded] == ["InternalServerError"], recorded
