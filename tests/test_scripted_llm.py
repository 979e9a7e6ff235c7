"""The scripted OpenAI-compatible server, driven through the real `openai` client (no retries, explicit
timeouts, as the app uses it)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import pytest_asyncio

from devtools.scripted_llm import NO_ANSWER_EN, NO_ANSWER_ZH, ScriptedLLM

PROJECT = Path(__file__).resolve().parent.parent

ZEBRA = "The great zebra migration crosses the Mara river every July. Crocodiles wait in the river."
PAPER = "Paper cranes are folded from a single square sheet. Origami needs no glue."


def messages(task: str, question: str = "When do the zebras cross the river?",
             passages: tuple[str, ...] = (ZEBRA, PAPER)) -> list[dict]:
    context = "\n".join(f"[{i}] (doc{i}.pdf, page {i}) {text}" for i, text in enumerate(passages, 1))
    return [{"role": "system", "content": f"You are a careful assistant.\nTASK: {task}\nCite passages as [n]."},
            {"role": "user", "content": f"CONTEXT:\n{context}\n\nQUESTION: {question}"}]


@pytest_asyncio.fixture
async def llm():
    server = ScriptedLLM()
    await server.start()
    yield server
    await server.stop()


@pytest_asyncio.fixture
async def client(llm):
    async with openai.AsyncOpenAI(base_url=llm.base_url, api_key="test", max_retries=0, timeout=5) as c:
        yield c


async def ask(client, task: str = "answer", **kwargs):
    kwargs.setdefault("messages", messages(task))
    return await client.chat.completions.create(model="scripted", **kwargs)


async def test_default_script_for_each_task(llm, client):
    summary = await ask(client, "summarize")
    assert summary.choices[0].message.content == "Summary: The great zebra migration crosses the Mara river every July."
    assert summary.choices[0].finish_reason == "stop" and summary.model == "scripted"

    answer = await ask(client, "answer", extra_headers={"X-Ragline-Step": "generate_answer",
                                                        "Idempotency-Key": "key-7"})
    text = answer.choices[0].message.content
    assert text == "According to [1], The great zebra migration crosses the Mara river every July."
    assert answer.usage.prompt_tokens > 10 and answer.usage.completion_tokens == len(text.split())
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens

    entities = json.loads((await ask(client, "extract_entities")).choices[0].message.content)
    assert 0 < len(entities) <= 5 and all(set(e) == {"text", "type"} for e in entities)
    assert "Mara" in [e["text"] for e in entities] and "The" not in [e["text"] for e in entities]

    assert (await ask(client, "summarize", messages=messages("summarize", passages=()))).choices[0].message.content \
        == "Summary: no context."
    empty = await ask(client, messages=messages("answer", "What is the capital of Peru?", passages=()))
    assert empty.choices[0].message.content == NO_ANSWER_EN
    chinese = await ask(client, messages=messages("answer", "秘鲁的首都是哪里？", passages=()))
    assert chinese.choices[0].message.content == NO_ANSWER_ZH
    no_marker = await ask(client, messages=[{"role": "user", "content": "hello"}])
    assert no_marker.choices[0].message.content == NO_ANSWER_EN

    assert [c.task for c in llm.calls] == ["summarize", "answer", "extract_entities", "summarize", "answer",
                                           "answer", "answer"]
    rec = llm.calls[1]
    assert rec.step == "generate_answer" and rec.idempotency_key == "key-7" and rec["task"] == "answer"
    assert rec["question"] == "When do the zebras cross the river?" and "[1] (doc1.pdf, page 1)" in rec.user_message
    assert rec.ok and rec.status == 200 and not rec.stream and rec.finished_at >= rec.started_at
    assert rec.reply == text
    assert [m.id for m in (await client.models.list()).data] == ["scripted"]


async def test_stream_is_split_into_deltas_with_usage(llm, client):
    expected = (await ask(client)).choices[0].message.content
    llm.set_stream_chunk_delay(0.01)
    stream = await ask(client, stream=True, stream_options={"include_usage": True})
    pieces, finishes, usage = [], [], None
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert len(pieces) >= 3 and "".join(pieces) == expected
    assert finishes == ["stop"]
    assert usage is not None and usage.completion_tokens == len(expected.split()) and usage.prompt_tokens > 0
    rec = llm.calls[-1]
    assert rec.stream and rec.ok and rec.finished_at - rec.started_at >= 0.01 * (len(pieces) - 1)

    # Without include_usage no usage chunk; a short answer still streams as >= 3 deltas.
    llm.script("answer", ["Yes."])
    pieces = [c.choices[0].delta.content async for c in await ask(client, stream=True)
              if c.choices and c.choices[0].delta.content]
    assert len(pieces) >= 3 and "".join(pieces) == "Yes."


async def test_embeddings_are_deterministic_and_normalised(llm, client):
    first = await client.embeddings.create(model="scripted", input=["alpha", "beta", "alpha"])
    again = await client.embeddings.create(model="scripted", input="alpha", encoding_format="float")
    vectors = [d.embedding for d in first.data]
    assert [d.index for d in first.data] == [0, 1, 2] and all(len(v) == 384 for v in vectors)
    assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-5 for v in vectors)
    assert vectors[0] == vectors[2] and vectors[0] != vectors[1]
    assert max(abs(a - b) for a, b in zip(vectors[0], again.data[0].embedding)) < 1e-6  # base64 is float32
    assert first.usage.prompt_tokens > 0 and first.usage.total_tokens == first.usage.prompt_tokens
    assert llm.count("embeddings") == 2 and llm.count("answer") == 0


async def test_scripted_replies_are_consumed_in_order(llm, client):
    llm.script("answer", ["first", "second"])
    llm.script("summarize", [{"content": "short", "delay": 0.05}])
    assert (await ask(client)).choices[0].message.content == "first"
    assert (await ask(client, "summarize")).choices[0].message.content == "short"
    assert (await ask(client)).choices[0].message.content == "second"
    assert (await ask(client)).choices[0].message.content.startswith("According to [1]")
    assert [c.scripted for c in llm.calls] == [True, True, True, False]

    llm.script("agent", [{"tool_calls": [{"name": "search", "arguments": {"query": "zebras", "top_k": 3}}]}])
    tools = [{"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
    reply = await ask(client, "agent", tools=tools)
    [call] = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "search" and json.loads(call.function.arguments) == {"query": "zebras", "top_k": 3}
    # Unscripted, a forced tool choice calls the tool with the question for its required string parameters.
    forced = await ask(client, "agent", tools=tools, tool_choice={"type": "function", "function": {"name": "search"}})
    assert json.loads(forced.choices[0].message.tool_calls[0].function.arguments) == {
        "query": "When do the zebras cross the river?"}
    # Streamed tool calls arrive as tool_call deltas.
    llm.script("agent", [{"tool_calls": [{"name": "search", "arguments": {"query": "q"}}]}])
    names, args = [], ""
    async for chunk in await ask(client, "agent", tools=tools, stream=True):
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            names += [tc.function.name] if tc.function.name else []
            args += tc.function.arguments or ""
    assert names == ["search"] and json.loads(args) == {"query": "q"}

    seen = []
    llm.script_fn("answer", lambda req: seen.append(req["messages"][-1]["content"]) or f"dynamic {len(seen)}")
    assert (await ask(client)).choices[0].message.content == "dynamic 1"
    assert "QUESTION:" in seen[0]
    llm.script_fn("answer", lambda req: None)  # None falls back to the default script
    assert (await ask(client)).choices[0].message.content.startswith("According to [1]")


async def test_rate_limit_carries_retry_after(llm, client):
    llm.script("answer", ["429"])
    with pytest.raises(openai.RateLimitError) as caught:
        await ask(client)
    assert caught.value.status_code == 429 and caught.value.response.headers["retry-after"] == "1"
    assert caught.value.body["type"] == "rate_limit_exceeded"
    llm.set_retry_after(7)
    llm.script("answer", ["429"])
    with pytest.raises(openai.RateLimitError) as caught:
        await ask(client, stream=True)
    assert caught.value.response.headers["retry-after"] == "7"
    assert [(c.fault, c.status, c.ok) for c in llm.calls] == [("429", 429, False), ("429", 429, False)]


async def test_503_and_other_status_faults(llm, client):
    llm.script("answer", ["503", "400"])
    with pytest.raises(openai.InternalServerError) as caught:
        await ask(client)
    assert caught.value.status_code == 503
    with pytest.raises(openai.BadRequestError):
        await ask(client)
    assert (await ask(client)).choices[0].message.content.startswith("According")


async def test_drop_is_a_connection_error(llm, client):
    llm.script("answer", ["drop", "drop"])
    for stream in (False, True):
        with pytest.raises(openai.APIConnectionError) as caught:
            await ask(client, stream=stream)
        assert type(caught.value) is openai.APIConnectionError  # not the APITimeoutError subclass
    assert (await ask(client)).choices[0].message.content.startswith("According")  # the client recovers
    assert [(c.fault, c.status) for c in llm.calls] == [("drop", None), ("drop", None), (None, 200)]


async def test_hang_is_a_timeout_and_stop_releases_hung_requests(llm, client):
    llm.script("answer", ["hang", "hang"])
    for stream in (False, True):
        with pytest.raises(openai.APITimeoutError):
            await ask(client, stream=stream, timeout=0.3)
    # The server notices the client went away and closes the record.
    records = await llm.wait_for_calls(2, "answer", finished=True, timeout=3)
    assert all(r.fault == "hang" and r.client_disconnected and r.status is None for r in records)

    llm.script("answer", ["hang"])
    pending = asyncio.ensure_future(ask(client, timeout=30))
    await llm.wait_for_calls(3, "answer")
    await llm.stop()
    with pytest.raises(openai.APIConnectionError) as caught:
        await asyncio.wait_for(pending, 5)
    assert type(caught.value) is openai.APIConnectionError  # released by the stop, not the client's 30 s timeout


async def test_malformed_bodies_raise_json_decode_errors(llm, client):
    """The exact exceptions the app has to map: the client does not wrap a broken 200 body."""
    llm.script("answer", ["malformed", "malformed"])
    with pytest.raises(json.JSONDecodeError):
        await ask(client)
    stream = await ask(client, stream=True)  # headers are fine; the broken chunk raises while iterating
    got = []
    with pytest.raises(json.JSONDecodeError):
        async for chunk in stream:
            got.append(chunk.choices[0].delta.content)
    assert got == ["Acc"]
    assert issubclass(json.JSONDecodeError, ValueError)
    assert [(c.fault, c.status, c.ok) for c in llm.calls] == [("malformed", 200, False)] * 2


async def test_random_faults_are_reproducible_with_a_seed(llm, client):
    async def run() -> list[str]:
        outcomes = []
        for _ in range(16):
            try:
                await ask(client, timeout=3)
                outcomes.append("ok")
            except (openai.OpenAIError, ValueError) as exc:
                outcomes.append(type(exc).__name__)
        return outcomes

    llm.set_faults(rate=0.5, kinds=["429", "503", "drop", "hang", "malformed"], seed=3)
    first = await run()
    faults = [c.fault for c in llm.calls]
    llm.reset()
    llm.set_faults(rate=0.5, kinds=["429", "503", "drop", "hang", "malformed"], seed=3)
    assert await run() == first
    assert [c.fault for c in llm.calls] == faults
    # Seed 3 happens to give every kind within 16 requests; the client sees each as its own exception type.
    assert set(faults) == {None, "429", "503", "drop", "hang", "malformed"}
    assert set(first) == {"ok", "RateLimitError", "InternalServerError", "APIConnectionError", "APITimeoutError",
                          "JSONDecodeError"}
    assert first.count("ok") == llm.count(ok_only=True)

    llm.set_faults(rate=0)
    assert (await ask(client)).choices[0].message.content.startswith("According")
    llm.set_faults(rate=1.0, kinds=["503"], tasks=["summarize"])  # only the listed tasks are eligible
    assert (await ask(client)).choices[0].message.content.startswith("According")
    with pytest.raises(openai.InternalServerError):
        await ask(client, "summarize")


async def test_counts_overlap_and_hundreds_of_concurrent_requests(llm, client):
    llm.set_delay(0.5)
    results = await asyncio.gather(*(ask(client, "answer" if i % 2 else "summarize",
                                         extra_headers={"X-Ragline-Step": f"s{i}"}) for i in range(300)))
    assert len(results) == 300
    assert llm.count() == 300 and llm.count("answer") == 150 and llm.count("summarize", ok_only=True) == 150
    assert llm.max_concurrency() >= 100
    a, s = llm.calls_for("answer")[0], llm.calls_for("summarize")[0]
    assert a.overlaps(s) and a.started_at < s.finished_at and s.started_at < a.finished_at
    assert all(c.duration >= 0.5 for c in llm.calls)
    assert {c.step for c in llm.calls} == {f"s{i}" for i in range(300)}

    llm.set_delay(0)
    llm.script("answer", ["429"])
    with pytest.raises(openai.RateLimitError):
        await ask(client)
    assert llm.count("answer") == 151 and llm.count("answer", ok_only=True) == 150
    llm.reset()
    assert llm.count() == 0 and llm.calls == [] and llm.delay == 0


async def test_http_control_and_stats(llm, client):
    async with httpx.AsyncClient(base_url=llm.url) as http:
        settings = (await http.post("/_control", json={"script": {"summarize": ["from http", "503"]},
                                                       "retry_after": "3", "stream_chunk_delay": 0.0})).json()
        assert settings["scripted"] == {"summarize": 2} and settings["retry_after"] == "3"
        assert (await ask(client, "summarize")).choices[0].message.content == "from http"
        with pytest.raises(openai.InternalServerError):
            await ask(client, "summarize")
        stats = (await http.get("/_stats")).json()
        assert stats["total"] == 2 and stats["ok"] == 1 and stats["by_task"] == {"summarize": {"total": 2, "ok": 1}}
        assert stats["faults"] == {"503": 1} and stats["calls"][0]["reply"] == "from http"
        assert (await http.post("/_control", json={"reset": True, "faults": {"rate": 1, "kinds": ["429"]}})
                ).json()["faults"]["rate"] == 1
        with pytest.raises(openai.RateLimitError):
            await ask(client)
        assert (await http.get("/_stats", params={"calls": 0})).json().keys() >= {"total", "by_task"}
        assert (await http.post("/_control", json={"nonsense": 1})).status_code == 400


def test_runs_as_its_own_process():
    with subprocess.Popen([sys.executable, "-m", "devtools.scripted_llm", "--port", "0", "--delay", "0.2"],
                          cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
        try:
            line = proc.stdout.readline()
            assert line.startswith("scripted LLM listening on http://127.0.0.1:"), line
            base_url = line.split()[-1]
            with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=5) as c:
                began = time.monotonic()
                reply = c.chat.completions.create(model="scripted", messages=messages("summarize"))
                assert reply.choices[0].message.content.startswith("Summary: ")
                assert time.monotonic() - began >= 0.2
            stats = httpx.get(base_url.removesuffix("/v1") + "/_stats").json()
            assert stats["total"] == 1 and stats["settings"]["delay"] == 0.2
        finally:
            proc.terminate()  # SIGTERM: a clean stop, exit status 0
            _, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, err


async def test_scopes_keep_scripts_delays_and_records_to_requests_with_their_token(llm, client):
    llm.script("answer", ["unscoped"])
    with llm.scope() as mine, llm.scope("OTHER-7") as other:
        assert mine.token.startswith("tok") and mine.token != other.token
        mine.script("answer", ["mine 1", "503"])
        other.script_fn("*", lambda body: {"content": "other's"})
        mine.set_delay(0.3)
        # A request without either token takes the unscoped script, without the scope's delay.
        assert (await ask(client)).choices[0].message.content == "unscoped"
        assert llm.calls[-1].scope is None
        # The token may sit anywhere in the messages (here: the question); the scope's script comes first.
        began = time.monotonic()
        assert (await ask(client, messages=messages("answer", f"Zebras? {mine.token}"))
                ).choices[0].message.content == "mine 1"
        assert time.monotonic() - began >= 0.3
        assert (await ask(client, "summarize", messages=messages("summarize", "Zebras? OTHER-7"))
                ).choices[0].message.content == "other's"
        with pytest.raises(openai.InternalServerError):
            await ask(client, messages=messages("answer", f"Again {mine.token}"))
        # Used up: the default reply, still counted as the scope's.
        assert (await ask(client, messages=messages("answer", f"Third {mine.token}"))
                ).choices[0].message.content.startswith("According to [1]")
        assert [c.question for c in mine.calls()] == [f"Zebras? {mine.token}", f"Again {mine.token}",
                                                      f"Third {mine.token}"]
        assert mine.count("answer") == 3 and mine.count("answer", ok_only=True) == 2 and mine.count("summarize") == 0
        assert other.count() == 1 and llm.count() == 5
        assert [c.scope for c in llm.calls] == [None, mine.token, "OTHER-7", mine.token, mine.token]
        assert (await mine.wait_for_calls(3, "answer", finished=True))[-1].ok
        # Embedding inputs count as the request's text too.
        await client.embeddings.create(model="scripted", input=[f"a passage {mine.token}"])
        assert mine.count("embeddings") == 1 and llm.count("embeddings", containing="OTHER-7") == 0
        mine.script("summarize", ["left over"])
        assert llm.settings()["scopes"][mine.token]["scripted"] == {"summarize": 1}
    # Leaving the scopes removes what they had not used: the token no longer changes anything.
    assert llm.settings()["scopes"] == {}
    assert (await ask(client, "summarize", messages=messages("summarize", f"Zebras? {mine.token}"))
            ).choices[0].message.content.startswith("Summary: ")
    assert llm.calls[-1].scope is None


async def test_scoped_stream_chunk_delay_and_cut_off_calls(llm, client):
    with llm.scope(stream_chunk_delay=0.05) as slow:
        began = time.monotonic()
        pieces = [c.choices[0].delta.content async for c in await ask(
            client, stream=True, messages=messages("answer", f"Slow? {slow.token}"))
            if c.choices and c.choices[0].delta.content]
        assert time.monotonic() - began >= 0.05 * (len(pieces) - 1)
        await ask(client, stream=True)  # not in the scope: no pause
        assert llm.calls[-1].scope is None

        # A client that goes away before the reply is sent is recorded as cut off; an injected fault is not.
        slow.set_delay(5)
        with pytest.raises(openai.APITimeoutError):
            await ask(client, messages=messages("answer", f"Gone? {slow.token}"), timeout=0.3)
        [gone] = [c for c in await slow.wait_for_calls(2, "answer", finished=True) if "Gone?" in c.question]
        assert gone.cut_off and gone.client_disconnected and gone.status is None and not gone.ok
    llm.script("answer", ["hang"])
    with pytest.raises(openai.APITimeoutError):
        await ask(client, timeout=0.3)
    hung = (await llm.wait_for_calls(4, "answer", finished=True))[-1]
    assert hung.fault == "hang" and hung.client_disconnected and not hung.cut_off


def test_clear_script_forgets_scoped_and_unscoped_scripts():
    llm = ScriptedLLM()
    llm.script("answer", ["a"])
    llm.script("answer", ["b", "c"], when="T1")
    assert llm.pending("answer") == 1 and llm.pending("answer", when="T1") == 2
    llm.clear_script("answer", when="T1")
    assert llm.pending("answer") == 1 and llm.pending("answer", when="T1") == 0
    llm.script("answer", ["b"], when="T1")
    llm.clear_script()
    assert llm.pending("answer") == 0 and llm.pending("answer", when="T1") == 0
    with pytest.raises(ValueError):
        llm.script("answer", ["x"], when="")
