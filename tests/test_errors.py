"""The error taxonomy at the edge of an activity: what the provider's answer becomes for Temporal."""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime

import httpx
import openai
import pytest
from temporalio import activity
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from ragline.provider_errors import translate_provider_errors
from temporal.errors import translate_errors


def _rate_limited(retry_after: str) -> openai.RateLimitError:
    request = httpx.Request("POST", "http://model/v1/chat/completions")
    response = httpx.Response(429, headers={"retry-after": retry_after}, request=request)
    return openai.RateLimitError("slow down", response=response, body=None)


@activity.defn
@translate_errors
async def call_the_model(retry_after: str) -> None:
    with translate_provider_errors("generate"):
        raise _rate_limited(retry_after)


async def _failure(retry_after: str, max_interval: timedelta) -> ApplicationError:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, retry_policy=RetryPolicy(maximum_interval=max_interval))
    with pytest.raises(ApplicationError) as caught:
        await env.run(call_the_model, retry_after)
    return caught.value


async def test_a_429_retries_when_the_provider_asks_within_the_steps_longest_backoff():
    soon = await _failure("7", timedelta(minutes=1))
    assert soon.next_retry_delay == timedelta(seconds=7) and not soon.non_retryable
    assert soon.type == "TransientError"
    # A spent daily quota asks for a day: the step retries after its longest backoff instead, and says so.
    quota = await _failure("86400", timedelta(minutes=1))
    assert quota.next_retry_delay == timedelta(minutes=1)
    assert "asked to wait 86400 s" in quota.message
    # Retry-After may be an HTTP date.
    when = format_datetime(datetime.now(timezone.utc) + timedelta(seconds=30), usegmt=True)
    dated = await _failure(when, timedelta(minutes=1))
    assert timedelta(seconds=25) <= dated.next_retry_delay <= timedelta(seconds=31)


async def test_a_retry_after_that_is_no_finite_number_is_ignored():
    assert (await _failure("inf", timedelta(minutes=1))).next_retry_delay is None
    assert (await _failure("1e400", timedelta(minutes=1))).next_retry_delay is None
    huge = await _failure("1e20", timedelta(minutes=1))  # finite, far too large for a timedelta
    assert huge.next_retry_delay == timedelta(minutes=1)


@activity.defn
@translate_errors
async def answered_with(status: int) -> None:
    with translate_provider_errors("generate"):
        request = httpx.Request("POST", "http://model/v1/chat/completions")
        raise openai.APIStatusError("no", response=httpx.Response(status, request=request), body=None)


@pytest.mark.parametrize(("status", "retried"), [(413, False), (400, False), (402, True), (503, True)])
async def test_a_request_the_provider_would_refuse_again_is_not_retried(status: int, retried: bool):
    with pytest.raises(ApplicationError) as caught:
        await ActivityEnvironment().run(answered_with, status)
    assert caught.value.non_retryable is not retried, caught.value
    assert f"provider answered {status}" in caught.value.message


def _stream_then(error: dict) -> openai.AsyncOpenAI:
    """A model that streams a first delta, then an error event (as vLLM and hosted APIs do mid-stream)."""
    def answer(request: httpx.Request) -> httpx.Response:
        events = [{"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m",
                   "choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]},
                  {"error": error}]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())
    return openai.AsyncOpenAI(base_url="http://model/v1", api_key="k", max_retries=0,
                              http_client=httpx.AsyncClient(transport=httpx.MockTransport(answer)))


@activity.defn
@translate_errors
async def stream_from(error: dict) -> None:
    with translate_provider_errors("generate"):
        stream = await _stream_then(error).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
        async for _ in stream:
            pass


@pytest.mark.parametrize(("error", "retried"), [
    ({"message": "context length exceeded", "type": "invalid_request_error", "code": "context_length_exceeded"}, False),
    ({"message": "the engine restarted", "type": "server_error", "code": None}, True)])
async def test_an_error_event_in_the_middle_of_a_stream_is_classified_like_a_status(error: dict, retried: bool):
    """The openai client raises the bare APIError for it, which escaped the taxonomy: always retried, with
    its traceback and no step prefix."""
    with pytest.raises(ApplicationError) as caught:
        await ActivityEnvironment().run(stream_from, error)
    assert caught.value.non_retryable is not retried, caught.value
    assert caught.value.type == ("TransientError" if retried else "ProviderRejectedError")
    assert caught.value.message == f"generate: provider sent an error in its stream: {error['message']}"
