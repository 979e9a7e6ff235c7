"""Traces: one per request, from the HTTP request through the workflows and every activity attempt
to the model call; the trace id comes back in the response header and the job view, and rides on
every CloudEvent and log line of the job."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import httpx
import structlog
from opentelemetry.trace import SpanKind, StatusCode

from ragline import keys as api_keys
from ragline.tracing import add_trace_id
from tests.helpers import eventually, read_events, waiting_reviews
from tests.pdfgen import pdf_bytes


def _trace(spans, trace_id: str) -> dict:
    return {s.context.span_id: s for s in spans.get_finished_spans()
            if format(s.context.trace_id, "032x") == trace_id}


def _chain(tree: dict, span) -> list[str]:
    """The names from `span` up to the root of its trace."""
    names = [span.name]
    while span.parent is not None and span.parent.span_id in tree:
        span = tree[span.parent.span_id]
        names.append(span.name)
    return names


def _one(tree: dict, name: str, kind: SpanKind | None = None):
    found = [s for s in tree.values() if s.name == name and (kind is None or s.kind == kind)]
    assert len(found) == 1, (name, [s.name for s in tree.values()])
    return found[0]


async def test_chat_turn_is_one_trace_from_request_to_model_call_with_a_retried_attempt(stack, spans):
    up = await stack.upload(("tides.pdf", pdf_bytes(["The tide table says high water is at noon."])),
                            collection="trace-chat")
    await stack.wait_done(up["job_id"])
    with stack.llm.scope() as mine, structlog.testing.capture_logs(
            processors=[structlog.contextvars.merge_contextvars, add_trace_id]) as logs:
        mine.script("answer", ["503"])  # the first generate_answer attempt fails, the second answers
        r = await stack.http.post("/v1/chats", json={"message": f"What is the tide table? {mine.token}",
                                                     "collection": "trace-chat"})
        assert r.status_code == 202, r.text
        trace_id = r.headers["x-trace-id"]
        job_id = r.json()["job_id"]
        job = await stack.wait_done(job_id)
    assert job["status"] == "completed", job
    assert job["trace_id"] == trace_id
    assert job["links"]["temporal_ui"].endswith(f"/namespaces/default/workflows/{job_id}/"
                                                f"{job['links']['temporal_ui'].split('/')[-2]}/history")

    tree = _trace(spans, trace_id)
    request = _one(tree, "POST /v1/chats", SpanKind.SERVER)
    attempts = sorted((s for s in tree.values() if s.name == "RunActivity:generate_answer"),
                      key=lambda s: s.start_time)
    assert len(attempts) == 2, [s.name for s in tree.values()]
    assert attempts[0].parent.span_id == attempts[1].parent.span_id  # one StartActivity, two attempts
    assert attempts[0].status.status_code == StatusCode.ERROR
    assert _chain(tree, attempts[1]) == [
        "RunActivity:generate_answer", "StartActivity:generate_answer", "StartChildWorkflow:ChatTurnWorkflow",
        "POST /v1/chats", *_chain(tree, request)[1:]]
    _one(tree, "SignalWithStartWorkflow:ChatSessionWorkflow")  # the session's start, in the same trace
    for attempt in attempts:  # each attempt made its own model call, a child of the attempt
        [call] = [s for s in tree.values() if s.parent and s.parent.span_id == attempt.context.span_id
                  and s.name == "chat scripted"]
        assert call.kind == SpanKind.CLIENT
    assert attempts[0].context.span_id in {s.parent.span_id for s in tree.values()
                                           if s.name == "chat scripted" and s.attributes.get("error.type")}
    # The model server got the trace too.
    calls = mine.calls("answer")
    assert len(calls) == 2 and all(c.headers["traceparent"].split("-")[1] == trace_id for c in calls), calls

    events = await read_events(stack, job_id)
    assert events and all(e["traceparent"].split("-")[1] == trace_id for _, e in events), events

    [failed] = [line for line in logs if line["event"] == "step attempt failed" and line.get("job_id") == job_id]
    assert failed["trace_id"] == trace_id and failed["step"] == "generate_answer" and failed["attempt"] == 1


async def test_ingestion_is_one_trace_through_child_workflows_and_activities(stack, spans):
    token = uuid.uuid4().hex[:8]
    r = await stack.http.post("/v1/documents", data={"collection": "trace"}, files=[
        ("files", (f"t{token}.pdf", pdf_bytes([f"The lighthouse {token} is painted red."])))])
    assert r.status_code == 202, r.text
    trace_id = r.headers["x-trace-id"]
    job = await stack.wait_done(r.json()["job_id"])
    assert job["status"] == "completed" and job["trace_id"] == trace_id

    tree = _trace(spans, trace_id)
    for step in ("extract_text", "chunk_text", "embed_chunks", "index_chunks", "prune_stale_chunks"):
        attempt = _one(tree, f"RunActivity:{step}")
        assert _chain(tree, attempt)[:5] == [
            f"RunActivity:{step}", f"StartActivity:{step}", "StartChildWorkflow:IngestDocumentWorkflow",
            "StartWorkflow:IngestWorkflow", "POST /v1/documents"]


async def test_each_turn_of_a_session_is_the_trace_of_its_own_request(stack, spans):
    """The session workflow lives in its first request's trace; each turn's job joins its own."""
    first = await stack.http.post("/v1/chats", json={"message": "Is the harbour open?", "collection": "trace-turns"})
    session_id = first.json()["session_id"]
    second = await stack.http.post("/v1/chats", json={"message": "And tomorrow?", "collection": "trace-turns",
                                                      "session_id": session_id})
    assert first.status_code == second.status_code == 202
    for r in (first, second):
        trace_id = r.headers["x-trace-id"]
        job = await stack.wait_done(r.json()["job_id"])
        assert job["status"] == "completed" and job["trace_id"] == trace_id, job
        tree = _trace(spans, trace_id)
        attempt = _one(tree, "RunActivity:retrieve_context")
        assert _chain(tree, attempt)[:4] == ["RunActivity:retrieve_context", "StartActivity:retrieve_context",
                                             "StartChildWorkflow:ChatTurnWorkflow", "POST /v1/chats"]
    assert first.headers["x-trace-id"] != second.headers["x-trace-id"]


async def test_what_a_tenants_gate_and_a_session_do_for_a_later_job_stays_out_of_the_first_jobs_trace(stack, spans):
    """A tenant's gate serves every job of the tenant, and a session every turn, for as long as they run. What
    they do for a later turn is traced in that turn's request (or the gate's own trace), not in the first's:
    else the first job's trace would grow with every job the tenant ever runs."""
    tenant = f"traced-{uuid.uuid4().hex[:8]}"  # a tenant of its own: the test starts its gate
    key = api_keys.create(stack.settings.effective_api_keys_file, tenant, "reviewer", f"{tenant}-reviewer")
    release = asyncio.Event()

    async def held_back(_request: dict) -> dict:
        await release.wait()
        return {"content": "The harbour opens at dawn [1]."}

    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60,
                                 headers={"Authorization": f"Bearer {key}"}) as http:
        tenants = dataclasses.replace(stack, http=http)
        up = await tenants.upload(("harbour.pdf", pdf_bytes(["The harbour opens at dawn and closes at dusk."])),
                                  collection="trace-later")
        upload_trace = (await tenants.wait_done(up["job_id"]))["trace_id"]  # the tenant's first job: starts its gate
        with stack.llm.scope() as holding:
            holding.script_fn("answer", held_back)
            first = await http.post("/v1/chats", json={"message": f"Is the harbour open? {holding.token}",
                                                        "collection": "trace-later"})
            assert first.status_code == 202, first.text
            await holding.wait_for_calls(1, "answer", timeout=60)
            # Accepted while the first turn runs: the session gives it its go by a signal once the first ends.
            second = await http.post("/v1/chats", json={"message": "And tomorrow?", "collection": "trace-later",
                                                         "session_id": first.json()["session_id"]})
            assert second.status_code == 202, second.text
            release.set()
            for r in (first, second):
                job = await tenants.wait_done(r.json()["job_id"])
                assert job["status"] == "completed", job
    first_trace, second_trace = first.headers["x-trace-id"], second.headers["x-trace-id"]
    first_tree, second_tree = _trace(spans, first_trace), _trace(spans, second_trace)

    def linked_to(span, trace_id: str) -> bool:
        return any(format(link.context.trace_id, "032x") == trace_id for link in span.links)

    # The session runs in its first request's trace: its handler of a later turn's submit is there (a span
    # linked to the later turn's trace, the interceptor's way for a signal). What it sends for that turn is not.
    assert [s.name for s in first_tree.values() if linked_to(s, second_trace)] == ["HandleSignal:submit"]
    gate_spans = {"RunWorkflow:TenantGateWorkflow", "HandleSignal:acquire", "SignalExternalWorkflow:slot_update"}
    for tree in (_trace(spans, upload_trace), first_tree):
        assert not gate_spans & {s.name for s in tree.values()}, sorted(s.name for s in tree.values())
    for tree in (first_tree, second_tree):  # each turn asked the gate, in its own trace
        _one(tree, "SignalWorkflow:acquire", SpanKind.CLIENT)
    proceed = _one(second_tree, "SignalChildWorkflow:proceed")
    assert "POST /v1/chats" in _chain(second_tree, proceed)
    # The gate runs in a trace of its own, linked to the job that started it; it links each ask to its job.
    [gate_root] = [s for s in spans.get_finished_spans() if s.name == "tenant gate" and linked_to(s, upload_trace)]
    gate_tree = _trace(spans, format(gate_root.context.trace_id, "032x"))
    _one(gate_tree, "RunWorkflow:TenantGateWorkflow")
    assert [s for s in gate_tree.values() if s.name == "HandleSignal:acquire" and linked_to(s, second_trace)]


async def test_a_job_of_a_tenant_named_like_a_scrape_path_is_traced_too(spans):
    """Only the scrape and health endpoints themselves go untraced: a job id that merely contains
    `metrics` or `healthz` (tenant `metrics-team`'s, say) still gets its span and its X-Trace-Id."""
    import httpx
    from fastapi import FastAPI

    from api import observability

    app = FastAPI()

    @app.get("/v1/jobs/{job_id}")
    async def job(job_id: str) -> dict:
        return {"job_id": job_id}

    observability.install(app)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as http:
        for job_id in ("metrics-team.chat-1f2e", "healthz.ingest-9a8b", "acme.chat-77aa"):
            r = await http.get(f"/v1/jobs/{job_id}")
            assert r.status_code == 200 and r.headers.get("X-Trace-Id"), (job_id, dict(r.headers))
            trace_id = int(r.headers["X-Trace-Id"], 16)
            assert any(s.context.trace_id == trace_id for s in spans.get_finished_spans()), job_id
        for path in ("/metrics", "/healthz"):
            r = await http.get(path)
            assert "X-Trace-Id" not in r.headers, path


async def test_a_reviewers_comment_leaves_in_no_span_of_the_rejected_turns_trace(stack, spans):
    """A rejection fails the turn with the reviewer's comment, which Temporal keeps encrypted; the spans that
    record that failure (the job's, the session's) are exported with its type and without its text."""
    up = await stack.upload(("herds.txt", b"The herds are counted each spring by the rangers of the valley."),
                            collection="trace-review")
    await stack.wait_done(up["job_id"])
    secret = f"CONFIDENTIAL-{uuid.uuid4().hex[:8]}"
    with stack.llm.scope() as mine:
        r = await stack.http.post("/v1/chats", json={"message": f"Who counts the herds? {mine.token}",
                                                     "collection": "trace-review", "require_review": True})
        assert r.status_code == 202, r.text
        trace_id, job_id = r.headers["x-trace-id"], r.json()["job_id"]
        await waiting_reviews(stack, job_id, timeout=30)
        r = await stack.http.post(f"/v1/jobs/{job_id}/review", json={
            "decision": "reject", "reviewer": "editor", "comment": f"{secret} census figures"})
        assert r.status_code == 200, r.text
        job = await stack.wait_done(job_id, timeout=60)
    assert job["status"] == "failed" and secret in job["error"]["message"]  # the person who asked reads it

    async def recorded() -> list:  # the job's last span ends as its workflow task completes
        tree = _trace(spans, trace_id)
        return list(tree.values()) if any(s.name == "CompleteWorkflow:ChatTurnWorkflow" for s in tree.values()) else []

    trace = await eventually(recorded, timeout=10, what="the turn's CompleteWorkflow span")
    failed = [e for s in trace for e in s.events if e.name == "exception"]
    assert failed and all(e.attributes.get("exception.type") for e in failed), \
        [(s.name, [dict(e.attributes) for e in s.events]) for s in trace]
    for s in trace:
        texts = [s.status.description or "", *(str(v) for v in (s.attributes or {}).values()),
                 *(str(v) for e in s.events for v in (e.attributes or {}).values())]
        assert not [t for t in texts if "census" in t or secret in t], (s.name, texts)


def test_a_workflow_coroutine_closed_from_another_context_leaves_its_trace_quietly(caplog):
    """A chat turn's run attaches its request's trace. Its coroutine, closed by the garbage collector once the worker
    let go of it (from another context than the one it ran in), detached the trace there: OpenTelemetry logged
    "Failed to detach context" with a traceback, in test runs and on a worker whose cache evicts held turns."""
    import contextvars

    from ragline import tracing

    class Forever:
        def __await__(self):
            yield

    async def turn() -> None:
        with tracing.attached("00-" + "a" * 32 + "-" + "b" * 16 + "-01"):
            await Forever()

    running = turn()
    contextvars.copy_context().run(running.send, None)  # its worker ran it in a context of its own
    with caplog.at_level("ERROR"):
        running.close()
    assert not [r for r in caplog.records if "detach" in r.getMessage()], caplog.text
