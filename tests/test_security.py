"""Security against the real stack: API keys and roles, rate limits, tenants that cannot see each
other (two tenants, the same collection name, every endpoint), per-tenant limits, encrypted payloads
and the codec endpoint, masking of sensitive data, and the audit log."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
import subprocess
import uuid

import httpx
import pytest
import structlog
from google.protobuf import json_format
from opentelemetry.trace import SpanKind
from prometheus_client import REGISTRY
from temporalio.api.common.v1 import Payload, WorkflowExecution
from temporalio.api.enums.v1 import EventType
from temporalio.api.workflowservice.v1 import DeleteWorkflowExecutionRequest
from temporalio.client import Client, WorkflowExecutionStatus as Status, WorkflowUpdateFailedError
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.converter import DataConverter
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment

from api.app import create_app
from api.auth import shown_address
from api.job_views import failure_message
from api.limits import BodyLimit
from devtools.devserver import temporal_binary
from models.chat import session_workflow_id
from ragline import audit, keys as api_keys, logs
from ragline.llm import ChatModel
from ragline.redact import redact
from ragline.settings import Settings
from temporal import codec as codec_mod
from temporal import search_attributes as sa
from temporal.client import connect
from tests.conftest import SERVER_STARTUP, free_port, running_stack, serving_api
from tests.helpers import (
    delegate_until, eventually, raw_temporal_records, read_events, session_turns, waiting_reviews,
)
from tests.pdfgen import pdf_bytes
from worker import fallback_model

DOC_A = "The {tag} lighthouse of Acme is painted red and white and has 120 steps."
DOC_B = "The {tag} granary of Globex stores barley and opens at dawn every Monday."


def _client(stack, key: str | None, **headers) -> httpx.AsyncClient:
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.AsyncClient(base_url=stack.base_url, timeout=60, headers=headers)


async def _end_jobs(client, *workflow_ids: str) -> None:
    """End every job a test started (and its sub-jobs, ids `<id>.n...`): terminate what still runs and
    wait until the server says it is closed, so that no later test (tests/test_contract.py's fuzzer
    operates every job tenant acme lists) finds it waiting."""
    for workflow_id in workflow_ids:
        family = f"(WorkflowId = '{workflow_id}' OR WorkflowId STARTS_WITH '{workflow_id}.')"

        async def running() -> list[str]:
            return [w.id async for w in client.list_workflows(f"{family} AND ExecutionStatus = 'Running'")]

        async def all_closed() -> bool:
            open_ids = await running()
            for open_id in open_ids:
                try:
                    await client.get_workflow_handle(open_id).terminate("test over")
                except RPCError as exc:
                    if exc.status != RPCStatusCode.NOT_FOUND:  # ended meanwhile
                        raise
            # The parent first, straight from the server (visibility lags a moment behind it).
            try:
                status = (await client.get_workflow_handle(workflow_id).describe()).status
            except RPCError as exc:
                if exc.status != RPCStatusCode.NOT_FOUND:
                    raise
                status = None
            return not open_ids and status != Status.RUNNING

        await eventually(all_closed, timeout=60, every=0.2, what=f"{workflow_id} and its sub-jobs closed")


# -- who is calling --------------------------------------------------------------------------------

async def test_every_route_but_the_probes_needs_a_known_key(stack):
    async with _client(stack, None) as anonymous, _client(stack, "rgl_not-a-key") as wrong:
        assert (await anonymous.get("/healthz")).status_code in (200, 503)
        assert (await anonymous.get("/livez")).json() == {"status": "up"}  # the probes carry no key
        routes = [("GET", "/v1/documents"), ("GET", "/v1/jobs"), ("GET", "/v1/reviews"),
                  ("POST", "/v1/search"), ("GET", "/v1/jobs/acme.agent-x"), ("GET", "/v1/chats/s1"),
                  ("POST", "/v1/chats"), ("POST", "/v1/agents"), ("GET", "/v1/jobs/acme.agent-x/events"),
                  ("POST", "/v1/jobs/x/retry"), ("POST", "/v1/jobs/x/discard"), ("POST", "/v1/jobs/x/review"),
                  ("POST", "/v1/jobs/x/cancel"), ("POST", "/v1/dead-letters/retry"),
                  ("POST", "/v1/documents")]
        for http in (anonymous, wrong):
            for method, path in routes:
                r = await http.request(method, path, json={} if method == "POST" else None)
                assert r.status_code == 401, (method, path, r.status_code, r.text)
                assert r.json()["error"]["code"] == "unauthenticated"
                assert r.headers["www-authenticate"] == "Bearer"
    async with _client(stack, None, **{"X-API-Key": stack.keys["member"]}) as by_header:
        assert (await by_header.get("/v1/jobs")).status_code == 200
    # Two different keys in one request (one tenant's, another's): neither is guessed at.
    async with _client(stack, stack.keys["reviewer"], **{"X-API-Key": stack.keys["other"]}) as both:
        r = await both.get("/v1/jobs")
        assert r.status_code == 401 and r.json()["error"]["code"] == "conflicting_keys", r.text
    async with _client(stack, stack.keys["member"], **{"X-API-Key": stack.keys["member"]}) as same_twice:
        assert (await same_twice.get("/v1/jobs")).status_code == 200
    assert (await stack.member_http.get("/v1/jobs")).status_code == 200


async def test_a_key_header_without_a_key_says_what_is_wrong_with_it(stack):
    """The README's `AUTH="Authorization: Bearer $KEY"` in a terminal where KEY is not set: curl sends `Bearer` alone,
    and `Authorization: <key>` without `Bearer ` is a common slip: both were told only that a key is required.
    Each is named (the route before the body is read too), and nothing of the header's value is repeated."""
    cases = [({"Authorization": "Bearer"}, "the Authorization header holds `Bearer` and no key after it"),
             ({"Authorization": "rgl_a-key-without-bearer"}, "the Authorization header is not `Bearer <key>`"),
             ({"X-API-Key": ""}, "the X-API-Key header is empty"),
             ({}, "an API key is required")]
    async with _client(stack, None) as http:
        for headers, says in cases:
            for method, path in (("GET", "/v1/jobs"), ("POST", "/v1/chats")):
                r = await http.request(method, path, headers=headers, json={} if method == "POST" else None)
                assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated"
                message = r.json()["error"]["message"]
                assert message.startswith(says) and "`Authorization: Bearer <key>`" in message, (headers, message)
                assert "rgl_a-key" not in message


async def test_a_flood_of_anonymous_health_probes_asks_temporal_once_per_period(stack):
    """GET /healthz needs no key and looks at Temporal with ~7 RPCs: the requests within
    RAGLINE_HEALTHZ_CACHE_SECONDS (and those that arrive while a look is under way) share one look."""
    app = create_app(stack.settings.model_copy(update={"healthz_cache_seconds": 3.0}))
    async with app.router.lifespan_context(app):
        service, calls = app.state.client.workflow_service, []
        for name in ("get_system_info", "describe_task_queue"):
            async def counted(*args, _rpc=getattr(service, name), _name=name, **kwargs):  # noqa: ANN202
                calls.append(_name)
                return await _rpc(*args, **kwargs)
            setattr(service, name, counted)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as anonymous:
            answers = await asyncio.gather(*(anonymous.get("/healthz") for _ in range(50)))
            one_look = list(calls)
            answers += [await anonymous.get("/healthz") for _ in range(10)]
            assert one_look.count("get_system_info") == 1 and len(one_look) > 1, one_look
            assert calls == one_look  # 60 requests, one look
            assert {(r.status_code, r.text) for r in answers} == {(answers[0].status_code, answers[0].text)}
            assert answers[0].json()["components"]["temporal"]["status"] == "up"
            await asyncio.sleep(3.1)
            assert (await anonymous.get("/healthz")).json() == answers[0].json()
            assert calls == one_look * 2  # looked again once the period was over


async def test_healthz_tells_anyone_each_status_and_only_an_operator_where_and_what_failed(tmp_path):
    """GET /healthz needs no key (probes): without an operator key it shows no address (the rate-limit
    Redis's may carry its password in a query) and no error as raised, which may name hosts. A key
    that is not valid gets the anonymous answer, not an error: a probe must not fail on it."""
    redis_port = free_port()  # nothing listens there: the counters are down
    settings = Settings(data_dir=tmp_path, temporal_address=f"127.0.0.1:{free_port()}", temporal_rpc_timeout=2,
                        rate_limit_storage=f"redis://ops:s3cret@127.0.0.1:{redis_port}/0?password=hunter2")
    keys = {role: api_keys.create(settings.effective_api_keys_file, "acme", role, role)
            for role in ("member", "reviewer", "codec", "operator")}
    app = create_app(settings)
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as http:
        for headers in ({}, {"X-API-Key": "rgl_not-a-key"},
                        *({"Authorization": f"Bearer {keys[role]}"} for role in ("member", "reviewer", "codec"))):
            r = await http.get("/healthz", headers=headers)
            assert r.status_code == 503, (headers, r.text)
            assert r.json() == {"status": "down", "components": {
                "rate_limits": {"status": "down", "reason": "the shared rate-limit counters do not answer: requests "
                                                            "are let through unlimited"},
                "temporal": {"status": "down", "reason": "cannot reach Temporal"},
                "worker": {"status": "unknown", "reason": "Temporal is down"}}}, headers
        r = await http.get("/healthz", headers={"X-API-Key": keys["operator"]})
        assert r.status_code == 503
        shown = r.json()["components"]
        assert shown["temporal"]["address"] == settings.temporal_address and shown["temporal"]["error"], shown
        assert shown["rate_limits"]["address"] == f"redis://127.0.0.1:{redis_port}/0"
        assert "s3cret" not in r.text and "hunter2" not in r.text


async def _raw(stack, head: str, body: bytes = b"", *, headers: dict | None = None) -> tuple[int, dict]:
    """Send a request as raw bytes (a length it does not keep, a chunked body) and read the answer the
    API gives, which must come without the rest of the body: reading it would wait forever."""
    host, port = stack.base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), timeout=30)
        head_lines = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=30)).decode().split("\r\n")
        length = next(int(h.split(":")[1]) for h in head_lines if h.lower().startswith("content-length:"))
        payload = await asyncio.wait_for(reader.readexactly(length), timeout=30)
        if headers is not None:
            headers.update(h.lower().split(": ", 1) for h in head_lines if ": " in h)
    finally:
        writer.close()
    return int(status_line.split()[1]), json.loads(payload)


async def test_a_large_body_is_refused_before_it_is_read(stack):
    """FastAPI reads a body before it checks the key: a body over its route's limit, or a large one without
    a known key, is refused from the request's head alone."""
    gigabyte = f"POST /v1/documents HTTP/1.1\nHost: x\nContent-Type: multipart/form-data; boundary=b\n" \
               f"Content-Length: {10**9}\n"
    status, body = await _raw(stack, gigabyte)
    assert (status, body["error"]["code"]) == (401, "unauthenticated")
    status, body = await _raw(stack, gigabyte + "X-API-Key: rgl_not_a_key\n")
    assert (status, body["error"]["code"]) == (401, "unauthenticated")
    # A body over its route's limit (a chat's: 1 MiB) is refused from its length, whoever sends it; like
    # every answer, the refusal carries its trace id.
    headers: dict[str, str] = {}
    status, body = await _raw(stack, f"POST /v1/chats HTTP/1.1\nHost: x\nContent-Type: application/json\n"
                                     f"Content-Length: {2 * 1024 * 1024}\nX-API-Key: {stack.keys['member']}\n",
                              headers=headers)
    assert (status, body["error"]["code"]) == (413, "body_too_large")
    assert len(headers["x-trace-id"]) == 32
    # A chunked body that grows past the limit is cut off there.
    chunk = b"x" * 65536
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(20))
    status, body = await _raw(stack, f"POST /v1/chats HTTP/1.1\nHost: x\nContent-Type: application/json\n"
                                     f"Transfer-Encoding: chunked\nX-API-Key: {stack.keys['member']}\n", chunked)
    assert (status, body["error"]["code"]) == (413, "body_too_large")


async def test_a_codec_key_is_refused_before_a_v1_body_is_read(stack):
    """The Web UI hands its codec key to every browser: with it, a large upload to a /v1 route is refused
    from the request's head, as authenticate refuses it, rather than read and spooled first."""
    ui_key = api_keys.create(stack.settings.effective_api_keys_file, "acme", "codec", f"ui-{uuid.uuid4().hex[:6]}")
    refused = {"code": "forbidden", "message": "a codec key may only call the codec endpoint (/codec)"}
    for path, content_type in (("/v1/documents", "multipart/form-data; boundary=b"), ("/v1/chats", "application/json")):
        status, body = await _raw(stack, f"POST {path} HTTP/1.1\nHost: x\nContent-Type: {content_type}\n"
                                         f"Content-Length: {30 * 1024 * 1024}\nX-API-Key: {ui_key}\n")
        assert (status, body["error"]) == (403, refused), path
    async with _client(stack, ui_key) as ui:  # the same answer as a route's own key check gives
        r = await ui.get("/v1/jobs")
        assert (r.status_code, r.json()["error"]) == (403, refused)


async def test_a_codec_body_over_its_cap_is_refused_from_its_length(stack):
    """The codec endpoint reads a body only up to RAGLINE_CODEC_MAX_BODY_MB (64 MiB), after the key check:
    a longer Content-Length is refused at once, with nothing of the body sent."""
    ui_key = api_keys.create(stack.settings.effective_api_keys_file, "acme", "codec", f"ui-{uuid.uuid4().hex[:6]}")
    over = stack.settings.codec_max_body_bytes + 1
    for path, key_header in (("/codec/decode", f"X-API-Key: {stack.keys['operator']}\n"),
                             (f"/codec/k/{ui_key}/encode", "")):
        status, body = await _raw(stack, f"POST {path} HTTP/1.1\nHost: x\nContent-Type: application/json\n"
                                         f"Content-Length: {over}\n{key_header}")
        assert (status, body["error"]["code"]) == (413, "body_too_large"), body
        assert "RAGLINE_CODEC_MAX_BODY_MB" in body["error"]["message"]
    # The key comes first: without one, or with a member's, the length is not even looked at.
    for key_header, code in (("", 401), (f"X-API-Key: {stack.keys['member']}\n", 403)):
        status, _ = await _raw(stack, f"POST /codec/decode HTTP/1.1\nHost: x\nContent-Length: {over}\n{key_header}")
        assert status == code


async def test_a_codec_body_without_a_length_is_read_only_up_to_its_cap(stack):
    """A body sent without a length (chunked) is read until it passes the cap, then refused: the rest of
    it is never asked for."""
    app = create_app(stack.settings.model_copy(update={"codec_max_body_mb": 1}))
    sent = 0

    async def three_mib():
        nonlocal sent
        for _ in range(48):
            sent += 1
            yield b" " * 65536

    async def payloads(body: bytes):
        for i in range(0, len(body), 7):  # a JSON body in small pieces, to be put together again
            yield body[i:i + 7]

    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://api",
            headers={"X-API-Key": stack.keys["operator"]}) as http:
        r = await http.post("/codec/encode", content=three_mib())
        assert (r.status_code, r.json()["error"]["code"]) == (413, "body_too_large"), r.text
        assert sent <= 1024 * 1024 // 65536 + 2  # read up to the cap, no further
        plain = {"metadata": {"encoding": base64.b64encode(b"json/plain").decode()},
                 "data": base64.b64encode(b'"chunked"').decode()}
        r = await http.post("/codec/decode", content=payloads(json.dumps({"payloads": [plain]}).encode()))
        assert r.status_code == 200 and r.json()["payloads"] == [plain], r.text


async def test_member_keys_cannot_decide_or_operate(stack):
    job_id = f"acme.agent-{uuid.uuid4().hex[:8]}"
    for path in (f"/v1/jobs/{job_id}/review", f"/v1/jobs/{job_id}/retry", f"/v1/jobs/{job_id}/discard"):
        body = {"decision": "approve", "reviewer": "m"} if path.endswith("review") else {}
        r = await stack.member_http.post(path, json=body)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", (path, r.text)
        # A reviewer gets past the role check: that job simply does not exist.
        assert (await stack.http.post(path, json=body)).status_code == 404
    # Each try is in the audit log, the member's refused for its role, under the id as asked.
    tried = [(e["action"], e["key_name"], e["outcome"]) for e in audit.read(stack.settings) if e["job_id"] == job_id]
    assert tried == [(a, k, o) for a in ("review", "retry", "discard")
                     for k, o in (("acme-member", "refused: forbidden"), ("acme-reviewer", "refused: job_not_found"))]


async def test_a_decision_refused_before_its_route_runs_is_audited_too(stack):
    """A body that fails validation (a decision "maybe", a negative extension) is refused before the route runs,
    and a member's bulk retry by its role: each is in the audit log as refused, with who sent it. They were
    not, though the audit promises refused attempts."""
    job_id = f"acme.agent-{uuid.uuid4().hex[:8]}"
    for body in ({"decision": "maybe", "reviewer": "r"},
                 {"decision": "approve", "reviewer": "r", "extra_budget": {"max_llm_calls": -1}}):
        r = await stack.http.post(f"/v1/jobs/{job_id}/review", json=body)
        assert r.status_code == 422, r.text
    collection = f"bulk-{uuid.uuid4().hex[:8]}"
    r = await stack.member_http.post("/v1/dead-letters/retry", json={"operator": "m", "collection": collection})
    assert (r.status_code, r.json()["error"]["code"]) == (403, "forbidden"), r.text
    entries = audit.read(stack.settings)
    tried = [(e["action"], e["key_name"], e["outcome"]) for e in entries if e["job_id"] == job_id]
    assert tried == [("review", "acme-reviewer", "refused: invalid_request")] * 2, tried
    [bulk] = [e for e in entries if e["action"] == "retry_dead_letters" and e.get("collection") == collection]
    assert (bulk["key_name"], bulk["outcome"]) == ("acme-member", "refused: forbidden")


async def test_a_revoked_keys_open_event_stream_ends_and_delivers_nothing_more(stack):
    """A stream outlives the request that opened it (a job waiting days for a review): revoking the key
    that opened it ends it, and the answer approved afterwards goes to the reviewer, not to that stream."""
    tag = uuid.uuid4().hex[:8]
    keys_file, name = stack.settings.effective_api_keys_file, f"revoked-{tag}"
    key = api_keys.create(keys_file, "acme", "member", name)
    collection = f"revoked-{tag}"
    seed = await stack.upload(("tides.txt", b"High tide at Vell harbour is at noon."), collection=collection)
    assert (await stack.wait_done(seed["job_id"]))["status"] == "completed"
    async with _client(stack, key) as member:
        r = await member.post("/v1/chats", json={"message": "When is high tide at Vell?", "collection": collection,
                                                 "require_review": True})
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]
        after: list[str] = []
        async with member.stream("GET", f"/v1/jobs/{job_id}/events", timeout=httpx.Timeout(60)) as events:
            lines = events.aiter_lines()
            async for line in lines:
                if line.startswith("data:") and json.loads(line[5:])["type"] == "ragline.review.requested":
                    break
            assert api_keys.remove(keys_file, name) == 1
            decided = await stack.http.post(f"/v1/jobs/{job_id}/review", json={"decision": "approve",
                                                                                "reviewer": "ana"})
            assert decided.status_code == 200, decided.text
            after = [line async for line in lines]  # to its end (a stream left open would time out)
        assert not [line for line in after if line.startswith("data:")], after
        assert ": the API key of this stream is no longer valid" in after, after
        # Its EventSource would come back, and stop at the 401.
        assert (await member.get(f"/v1/jobs/{job_id}/events")).status_code == 401
    assert (await stack.wait_done(job_id))["status"] == "completed"
    assert "ragline.answer.completed" in [e["type"] for _, e in await read_events(stack, job_id)]


async def test_keys_command_prints_a_key_once_and_stores_only_its_hash(stack, tmp_path):
    path = tmp_path / "keys.toml"
    out = subprocess.run([_python(), "-m", "ragline.keys", "--file", str(path), "create", "--tenant", "initech",
                          "--role", "reviewer", "--name", "ops"], capture_output=True, text=True, check=True)
    key = out.stdout.strip()
    assert key.startswith("rgl_") and f"added to {path}" in out.stderr, out.stderr  # which file: say so
    stored = path.read_text()
    assert key not in stored and api_keys.digest(key) in stored
    [entry] = api_keys.load(path).keys
    assert (entry.tenant, entry.role, entry.name) == ("initech", "reviewer", "ops")
    bad = subprocess.run([_python(), "-m", "ragline.keys", "--file", str(path), "create", "--tenant", "Not OK"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "tenant: String should match pattern" in bad.stderr, bad.stderr
    assert "errors.pydantic.dev" not in bad.stderr  # a person's message, not the library's report

    def keys(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([_python(), "-m", "ragline.keys", "--file", str(path), *args],
                              capture_output=True, text=True)

    # Listed with its id, revoked by it: the API refuses it as soon as it re-reads the file.
    listed = keys("list")
    assert str(path) in listed.stderr and f"initech\treviewer\tops\t{entry.sha256[:12]}…" in listed.stdout
    # What a person wrote in the file stays: comments, another key, a tenant's limits as written.
    path.write_text(path.read_text() + "# the CI's key\n[[keys]]\ntenant = \"initech\"\nsha256 = \"" + "a" * 64 +
                    "\"\nname = \"ci\"\n\n[tenants.initech]\nmax_upload_mb = 1   # keep PDFs short\n")
    assert keys("revoke", "--id", entry.sha256[:12] + "…").returncode == 0
    assert [k.name for k in api_keys.load(path).keys] == ["ci"] and keys("revoke", "--name", "ops").returncode == 1
    assert "# the CI's key" in path.read_text() and "max_upload_mb = 1   # keep PDFs short" in path.read_text()
    assert api_keys.digest(key) not in path.read_text()
    # The wrong folder: it says which file it looked for, rather than list nothing.
    elsewhere = subprocess.run([_python(), "-m", "ragline.keys", "--file", str(tmp_path / "none.toml"), "list"],
                               capture_output=True, text=True)
    assert elsewhere.returncode == 1 and "no keys file at" in elsewhere.stderr and "none.toml" in elsewhere.stderr


def test_revoking_the_last_key_locks_it_out_of_a_running_api(tmp_path):
    """The keys file README shows starts with `[[keys]]`: revoking its only key left an empty file, which a
    running API takes for an edit under way, keeping the revoked key in force until its restart."""
    path = tmp_path / "keys.toml"
    key = "rgl_" + "k" * 40
    path.write_text(f'[[keys]]\ntenant = "acme"\nsha256 = "{api_keys.digest(key)}"\nname = "only"\n')
    ring = api_keys.KeyRing(path)
    assert ring.find(key).name == "only"
    assert api_keys.remove(path, "only") == 1
    assert ring.find(key) is None and len(ring) == 0
    assert api_keys.load(path).keys == []


def test_a_broken_edit_of_the_keys_file_keeps_the_keys_read_before(tmp_path):
    """A typo while an operator edits the keys file must not lock every key out (a 500 on every request)."""
    path = tmp_path / "keys.toml"
    first = api_keys.create(path, "acme", "member", "first")
    ring = api_keys.KeyRing(path)
    assert ring.find(first).name == "first"
    path.write_text(path.read_text() + "\n[[keys]\ntenant = \n")  # half-typed
    assert ring.find(first).name == "first"
    path.write_text(path.read_text().rsplit("\n[[keys]\n", 1)[0] + "\n")  # fixed again
    second = api_keys.create(path, "acme", "member", "second")
    assert (ring.find(first).name, ring.find(second).name) == ("first", "second")
    broken = tmp_path / "broken.toml"
    broken.write_text("[[keys]")
    with pytest.raises(api_keys.KeysFileError):  # a file that never read well is an error at once
        api_keys.KeyRing(broken).find(first)


def test_a_keys_file_caught_mid_rewrite_keeps_the_keys_read_before(tmp_path):
    """`cp new.toml keys.toml` truncates before it writes, and an editor may move the file away before it
    writes the new one: read then, the file is "no keys", and every key (every open event stream) would stop."""
    path = tmp_path / "keys.toml"
    key = api_keys.create(path, "acme", "member", "first")
    ring = api_keys.KeyRing(path)
    assert ring.find(key).name == "first"
    text = path.read_text()
    path.write_text("")  # truncated, not yet written
    assert ring.find(key).name == "first"
    path.unlink()  # moved away, the new one not yet there
    assert ring.find(key).name == "first"
    path.write_text(text.replace('name = "first"', 'name = "renamed"'))
    assert ring.find(key).name == "renamed"  # the file that reads again is the one in force


def test_a_misspelt_limit_in_the_keys_file_is_refused_with_its_name(tmp_path, caplog):
    """`request_per_minute = 5` (for requests_per_minute) or `max_upload_MB`: read as no limit at all, the
    operator's limit went unenforced without a word. Now the edit is refused with the line's name, and the
    limits read before stay in force."""
    path = tmp_path / "keys.toml"
    key = api_keys.create(path, "acme", "member", "slow", requests_per_minute=5)
    path.write_text(path.read_text() + "\n[tenants.acme]\nmax_upload_mb = 1\n")
    ring = api_keys.KeyRing(path)
    assert (ring.find(key).requests_per_minute, ring.limits("acme").max_upload_mb) == (5, 1)
    for right, wrong in (("requests_per_minute", "request_per_minute"), ("max_upload_mb", "max_upload_MB")):
        path.write_text(path.read_text().replace(right, wrong))
        with pytest.raises(api_keys.KeysFileError, match=wrong):
            api_keys.load(path)
        assert (ring.find(key).requests_per_minute, ring.limits("acme").max_upload_mb) == (5, 1)
        path.write_text(path.read_text().replace(wrong, right))


async def test_an_api_on_a_keys_file_that_does_not_read_stops_at_start_with_the_reason(tmp_path):
    """Not a 500 on every request: the API does not start, and says which line is wrong."""
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text('[tenants.acme]\nmax_upload_MB = 1\n')
    app = create_app(Settings(data_dir=tmp_path, api_keys_file=keys_file, codec_keys_file=tmp_path / "codec.toml"))
    with pytest.raises(api_keys.KeysFileError, match="max_upload_MB"):
        async with app.router.lifespan_context(app):
            pass


async def test_a_key_over_its_rate_gets_429_with_retry_after(stack):
    key = api_keys.create(stack.settings.effective_api_keys_file, "acme", "member", "slow", requests_per_minute=3)
    async with _client(stack, key) as http:
        codes = [(await http.get("/v1/jobs?limit=1")).status_code for _ in range(3)]
        assert codes == [200, 200, 200]
        r = await http.get("/v1/jobs?limit=1")
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
        assert 1 <= int(r.headers["retry-after"]) <= 60
    # Another key is not held back by it.
    assert (await stack.member_http.get("/v1/jobs?limit=1")).status_code == 200


async def test_an_upload_counts_once_against_its_keys_rate_and_over_it_is_refused(stack):
    """A body larger than a JSON request (an upload) is counted against the key's rate before it is read,
    so a key over its rate gets 429 without the server taking in its megabytes, and only once."""
    key = api_keys.create(stack.settings.effective_api_keys_file, "acme", "member", "uploader", requests_per_minute=3)
    big = ("Lighthouse log. " * 80_000 + uuid.uuid4().hex).encode()  # ~1.3 MB: over the small-body limit
    async with _client(stack, key) as http:
        first = await http.post("/v1/documents", files=[("files", ("log.txt", big))], data={"collection": "rated"})
        assert first.status_code == 202, first.text
        assert [(await http.get("/v1/jobs?limit=1")).status_code for _ in range(2)] == [200, 200]
        again = await http.post("/v1/documents", files=[("files", ("log2.txt", big + b"!"))],
                                data={"collection": "rated"})
        assert (again.status_code, again.json()["error"]["code"]) == (429, "rate_limited")
    # Its thousands of chunks are not this test's business.
    assert (await stack.http.post(f"/v1/jobs/{first.json()['job_id']}/cancel")).status_code == 202

    # The refusal comes before the body is read: the app under the body limit never asks for it.
    reads: list[dict] = []
    sent: list[dict] = []

    async def receive() -> dict:
        reads.append({})
        return {"type": "http.request", "body": b"x" * 65536, "more_body": True}

    async def send(message: dict) -> None:
        sent.append(message)

    async def route(scope, receive, send) -> None:  # noqa: ANN001 - what FastAPI would do: read it all
        raise AssertionError("the route ran for a key over its rate")

    limited = BodyLimit(route, limits={"/v1/documents": 100 * 1024 * 1024}, guard=lambda: stack.app.state.guard)
    await limited({"type": "http", "method": "POST", "path": "/v1/documents", "headers": [
        (b"x-api-key", key.encode()), (b"content-length", str(50 * 1024 * 1024).encode()),
        (b"content-type", b"multipart/form-data; boundary=x")]}, receive, send)
    assert sent[0]["status"] == 429 and reads == []


async def test_api_processes_share_each_keys_rate_through_redis(stack, redis_server):
    """Two API processes (two apps, each with its own limiter) on one Redis: a key's requests per minute
    count across both, so running more API replicas does not multiply anyone's rate."""
    key = api_keys.create(stack.settings.effective_api_keys_file, "acme", "member", "shared", requests_per_minute=4)
    settings = stack.settings.model_copy(update={"rate_limit_storage": redis_server.url})
    async with serving_api(create_app(settings)) as url_a, serving_api(create_app(settings)) as url_b, \
            httpx.AsyncClient(base_url=url_a, headers={"X-API-Key": key}) as a, \
            httpx.AsyncClient(base_url=url_b, headers={"X-API-Key": key}) as b:
        codes = [(await http.get("/v1/jobs?limit=1")).status_code for http in (a, b, a, b)]
        assert codes == [200, 200, 200, 200]
        for http in (a, b):
            r = await http.get("/v1/jobs?limit=1")
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited", r.text
            assert 1 <= int(r.headers["retry-after"]) <= 60
        # Where the counters are is for an operator's eyes (anyone may ask /healthz).
        health = (await a.get("/healthz", headers={"X-API-Key": stack.keys["operator"]})).json()
        assert health["components"]["rate_limits"] == {"status": "up", "address": redis_server.url}
        assert (await a.get("/healthz")).json()["components"]["rate_limits"] == {"status": "up"}


def _unchecked_requests() -> float:
    return REGISTRY.get_sample_value("ragline_rate_limit_storage_errors_total")


async def test_requests_go_through_while_the_shared_counters_are_down_and_are_held_again_after(
        stack, redis_server):
    key = api_keys.create(stack.settings.effective_api_keys_file, "acme", "member", "outage", requests_per_minute=2)
    settings = stack.settings.model_copy(update={"rate_limit_storage": redis_server.url})
    app = create_app(settings)
    async with serving_api(app) as url, httpx.AsyncClient(base_url=url, headers={"X-API-Key": key}) as http:
        redis_server.stop()
        unchecked = _unchecked_requests()
        # Over the key's rate, yet served: the limit protects the service, its outage must not stop it.
        assert [(await http.get("/v1/jobs?limit=1")).status_code for _ in range(4)] == [200] * 4
        assert _unchecked_requests() - unchecked == 4  # only this test's app has a Redis it cannot reach
        health = (await http.get("/healthz")).json()
        assert health["status"] == "degraded"
        assert health["components"]["rate_limits"]["status"] == "down"
        assert "let through unlimited" in health["components"]["rate_limits"]["reason"]

        await redis_server.start()  # back, empty, on the same address
        # Seen back by /healthz (a probe every few seconds on a cluster), or by a request once the pause
        # after the failure is over: the key is held to its rate again.
        assert (await http.get("/healthz")).json()["components"]["rate_limits"]["status"] == "up"
        assert [(await http.get("/v1/jobs?limit=1")).status_code for _ in range(3)] == [200, 200, 429]


@pytest.mark.parametrize("pause, tries", [(None, 1), (0, 5)], ids=["default-pause", "no-pause"])
async def test_a_redis_that_hangs_costs_one_request_its_timeout_not_every_request(stack, pause, tries):
    """A Redis that accepts connections and never answers (a host gone silent): the first request waits
    for the timeout and is let through; the requests right after it skip the counters instead of each
    waiting as long (they would each open a new connection to try). With
    RAGLINE_RATE_LIMIT_STORAGE_PAUSE=0 every request tries, and waits."""
    connections = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        await reader.read()  # until the client gives up and closes

    silent = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    key = api_keys.create(stack.settings.effective_api_keys_file, "acme", "member", "hang", requests_per_minute=2)
    update = {"rate_limit_storage": f"redis://127.0.0.1:{port}/0", "rate_limit_storage_timeout": 0.2}
    if pause is not None:
        update["rate_limit_storage_pause"] = pause
    settings = stack.settings.model_copy(update=update)
    try:
        async with serving_api(create_app(settings)) as url, \
                httpx.AsyncClient(base_url=url, headers={"X-API-Key": key}) as http:
            assert [(await http.get("/v1/jobs?limit=1")).status_code for _ in range(5)] == [200] * 5
            assert len(connections) == tries
    finally:
        silent.close()
        for writer in connections:
            writer.close()


def test_rate_limit_storage_must_be_memory_or_redis():
    for good in ("memory://", "redis://cache:6379/0", "rediss://:secret@cache:6380", "redis+unix:///run/redis.sock"):
        assert Settings(rate_limit_storage=good).rate_limit_storage == good
    for bad in ("memcached://cache:11211", "mongodb://db", "redis", ""):
        with pytest.raises(ValueError, match="rate_limit_storage"):
            Settings(rate_limit_storage=bad)
    assert shown_address("rediss://:secret@cache:6380/1") == "rediss://cache:6380/1"
    assert shown_address("redis://cache:6379/0?password=secret&db=1") == "redis://cache:6379/0"
    assert shown_address("redis://u:p%40ss@cache/0#x") == "redis://cache/0"
    assert shown_address("redis://cache/0?password=a@secret") == "redis://…"  # which part is the password?
    for bad in ({"rate_limit_storage_timeout": 0}, {"rate_limit_storage_pause": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Settings(**bad)


# -- tenants ---------------------------------------------------------------------------------------

async def test_tenants_see_only_their_own_documents_search_hits_jobs_and_chats(stack):
    tag = uuid.uuid4().hex[:8]
    collection = f"shared-{tag}"  # the same collection name in both tenants
    same = f"Both tenants upload this very file about the {tag} ferry.".encode()
    mine = await stack.upload((f"a-{tag}.txt", DOC_A.format(tag=tag).encode()), ("same.txt", same),
                              collection=collection)
    r = await stack.other_http.post("/v1/documents", data={"collection": collection}, files=[
        ("files", (f"b-{tag}.txt", DOC_B.format(tag=tag).encode())), ("files", ("same.txt", same))])
    assert r.status_code == 202, r.text
    theirs = r.json()
    # The same bytes in the same collection are two documents, two jobs: no sharing, no "duplicate".
    assert theirs["duplicate"] is False
    assert {d["document_id"] for d in mine["documents"]}.isdisjoint(d["document_id"] for d in theirs["documents"])
    assert mine["job_id"].startswith("acme.") and theirs["job_id"].startswith("globex.")
    assert (await stack.wait_job(mine["job_id"]))["status"] == "completed"
    assert (await _wait(stack.other_http, theirs["job_id"]))["status"] == "completed"

    # Documents (listed from visibility, a moment after their jobs start: once a tenant's own are listed, the
    # other's would be too)
    async def documents(http, own: dict) -> list[dict]:  # noqa: ANN001
        docs = (await http.get(f"/v1/documents?collection={collection}")).json()["documents"]
        return docs if {d["document_id"] for d in own["documents"]} <= {d["document_id"] for d in docs} else []

    docs_a = await eventually(lambda: documents(stack.http, mine), what="acme's documents listed")
    docs_b = await eventually(lambda: documents(stack.other_http, theirs), what="globex's documents listed")
    assert {d["document_id"] for d in docs_a} == {d["document_id"] for d in mine["documents"]}
    assert {d["document_id"] for d in docs_b} == {d["document_id"] for d in theirs["documents"]}

    # Search: each tenant finds only its own passages, even for the other's words.
    for http, own, foreign in ((stack.http, "lighthouse", "granary"), (stack.other_http, "granary", "lighthouse")):
        for query in (f"{tag} lighthouse steps", f"{tag} granary barley"):
            r = await http.post("/v1/search", json={"query": query, "collection": collection, "top_k": 10})
            hits = r.json()["hits"]
            assert hits and not any(foreign in h["text"] for h in hits), (query, hits)
    # Qdrant itself: the points carry the tenant, and counting is per tenant.
    assert stack.index.count("acme", collection) > 0 and stack.index.count("globex", collection) > 0
    assert stack.index.count("nobody", collection) == 0

    # Jobs: listing, reading, events, operating another tenant's job: 404, never 403.
    async def jobs_b() -> set[str]:  # once its own job is listed, acme's would be too
        listed = {j["job_id"] for j in (await stack.other_http.get("/v1/jobs?limit=1000")).json()["jobs"]}
        return listed if theirs["job_id"] in listed else set()

    listed_b = await eventually(jobs_b, what="globex's upload listed for globex")
    assert mine["job_id"] not in listed_b and theirs["job_id"] in listed_b
    assert all(j.startswith("globex.") for j in listed_b)
    child = (await stack.http.get(f"/v1/jobs/{mine['job_id']}")).json()["result"]["documents"][0]["job_id"]
    local = mine["job_id"].split(".", 1)[1]
    for job_id in (mine["job_id"], local, child):
        for method, path, body in (("GET", f"/v1/jobs/{job_id}", None), ("GET", f"/v1/jobs/{job_id}/events", None),
                                   ("POST", f"/v1/jobs/{job_id}/retry", {}), ("POST", f"/v1/jobs/{job_id}/discard", {}),
                                   ("POST", f"/v1/jobs/{job_id}/review", {"decision": "approve", "reviewer": "x"})):
            r = await stack.other_http.request(method, path, json=body)
            assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found", (method, path, r.text)
            # The error names the id as sent, not as read inside the caller's tenant.
            assert r.json()["error"]["message"] == f"no job with id {job_id!r}", (method, path, r.text)

    # Chats: the same session id (and Idempotency-Key) in both tenants are two sessions.
    session = f"sess-{tag}"
    a = await stack.chat(f"How many steps has the {tag} lighthouse?", session_id=session, collection=collection,
                         idempotency_key="k1")
    r = await stack.other_http.post("/v1/chats", headers={"Idempotency-Key": "k1"}, json={
        "message": f"When does the {tag} granary open?", "session_id": session, "collection": collection})
    assert r.status_code == 202, r.text
    b = r.json()
    assert b["duplicate"] is False and a["job_id"] != b["job_id"]
    turn_a = await stack.wait_job(a["job_id"])
    turn_b = await _wait(stack.other_http, b["job_id"])
    assert turn_a["status"] == turn_b["status"] == "completed", (turn_a, turn_b)
    own_a = {d["document_id"] for d in mine["documents"]}
    own_b = {d["document_id"] for d in theirs["documents"]}
    assert {c["document_id"] for c in turn_a["result"]["citations"]} <= own_a
    assert {c["document_id"] for c in turn_b["result"]["citations"]} <= own_b
    view_a = await session_turns(stack.http, session, a["job_id"])
    view_b = await session_turns(stack.other_http, session, b["job_id"])
    assert [t["job_id"] for t in view_a] == [a["job_id"]]
    assert [t["job_id"] for t in view_b] == [b["job_id"]]
    assert (await stack.other_http.get(f"/v1/chats/only-{tag}")).status_code == 404


async def test_tenants_see_only_their_own_agents_and_reviews(stack, scripted_llm):
    token = f"tok{uuid.uuid4().hex[:8]}"
    scripted_llm.script_fn("agent", delegate_until(leaf_depth=1, token=token), when=token)
    started: list[str] = []  # ended in `finally` whatever happens: a review left waiting would outlive the test
    try:
        r = await stack.http.post("/v1/agents", json={"goal": f"Survey {token}", "max_depth": 0,
                                                      "collection": "security-agents"})
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]
        started.append(job_id)
        [review] = await waiting_reviews(stack, job_id)
        assert review["workflow_id"] == job_id and job_id.startswith("acme.")
        # The other tenant has a review waiting too: listed for it, never for acme.
        r = await stack.other_http.post("/v1/agents", json={"goal": f"Inspect {token}", "max_depth": 0,
                                                            "collection": "security-agents"})
        assert r.status_code == 202, r.text
        their_job = r.json()["job_id"]
        started.append(their_job)
        assert their_job.startswith("globex.")

        async def their_reviews() -> list[dict]:
            reviews = (await stack.other_http.get("/v1/reviews")).json()["reviews"]
            return reviews if any(x["job_id"] == their_job for x in reviews) else []

        theirs = await eventually(their_reviews, what="globex's review listed for globex")
        assert all(not x["job_id"].startswith("acme.") for x in theirs)
        ours = (await stack.http.get("/v1/reviews")).json()["reviews"]
        assert ours and all(x["job_id"].startswith("acme.") for x in ours)
        assert their_job not in {x["job_id"] for x in ours}
        r = await stack.other_http.post(f"/v1/jobs/{their_job}/review", json={"decision": "reject", "reviewer": "eve"})
        assert r.status_code == 200, r.text
        r = await stack.other_http.post(f"/v1/jobs/{job_id}/review", json={"decision": "approve", "reviewer": "eve"})
        assert r.status_code == 404
        assert (await stack.http.get(f"/v1/jobs/{job_id}")).json()["status"] == "waiting_review"
        r = await stack.http.post(f"/v1/jobs/{job_id}/review",
                                  json={"decision": "approve", "reviewer": "Ada", "extra_depth": 1})
        assert r.status_code == 200, r.text
        assert (await stack.wait_done(job_id))["status"] == "completed"

        async def their_job_done() -> bool:
            return (await stack.other_http.get(f"/v1/jobs/{their_job}")).json()["status"] == "completed"

        await eventually(their_job_done, timeout=60, what="globex's agent completed")
    finally:
        scripted_llm.clear_script(when=token)
        await _end_jobs(stack.client, *started)
    # The audit log names the key that decided, and the refused attempt of the other tenant is not there
    # under this job's tenant.
    entries = [e for e in audit.read(stack.settings) if e["job_id"] == job_id]
    [decided] = [e for e in entries if e["outcome"] == "accepted"]
    assert decided["tenant"] == "acme" and decided["key_name"] == "acme-reviewer"
    assert decided["action"] == "review" and decided["decision"] == "approve" and decided["reviewer"] == "Ada"


# -- per-tenant limits -------------------------------------------------------------------------------

async def test_a_tenant_upload_limit_from_the_keys_file(stack):
    path = stack.settings.effective_api_keys_file
    key = api_keys.create(path, "initech", "member", "initech-member")
    with path.open("a") as f:
        f.write("\n[tenants.initech]\nmax_upload_mb = 0.001\nmax_pages = 1\n")
    async with _client(stack, key) as http:
        r = await http.post("/v1/documents", data={"collection": "security-limits"},
                            files=[("files", ("big.txt", b"x" * 2000))])
        assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large", r.text
        r = await http.post("/v1/documents", data={"collection": "security-limits"},
                            files=[("files", ("small.txt", b"a small text of one page"))])
        assert r.status_code == 202, r.text
        # Accepted means indexed (and no job of the test's is left running for the tests after it).
        assert (await _wait(http, r.json()["job_id"]))["status"] == "completed"
    # acme keeps the server's limit.
    body = await stack.upload(("big.txt", b"x " * 2000), collection="security-limits")
    assert (await stack.wait_done(body["job_id"]))["status"] == "completed"


async def test_a_tenant_holds_at_most_its_max_documents_in_the_vector_store(stack):
    """`max_documents = 2`: of three documents uploaded together, one fails with the reason and leaves
    nothing to find; the same bytes sent again are not refused; another collection counts too; once a
    document is removed, the refused one fits."""
    tenant = f"quota-{uuid.uuid4().hex[:8]}"
    path = stack.settings.effective_api_keys_file
    key = api_keys.create(path, tenant, "reviewer", f"{tenant}-reviewer")
    with path.open("a") as f:
        f.write(f"\n[tenants.{tenant}]\nmax_documents = 2\n")
    texts = {name: f"The {name.removesuffix('.txt')} lighthouse keeper lights the lamp at dusk.".encode()
             for name in ("north.txt", "south.txt", "west.txt")}

    async def upload(http: httpx.AsyncClient, collection: str, *names: str) -> dict:
        r = await http.post("/v1/documents", data={"collection": collection},
                            files=[("files", (name, texts.get(name, f"The {name} buoy.".encode()))) for name in names])
        assert r.status_code == 202, r.text  # accepted: the quota is the store's, checked by the worker
        return await _wait(http, r.json()["job_id"])

    async with _client(stack, key) as http:
        job = await upload(http, "quota-a", *texts)
        assert job["status"] == "completed", job
        outcomes = {d["filename"]: d for d in job["result"]["documents"]}
        refused = [name for name, d in outcomes.items() if d["status"] == "failed"]
        assert len(refused) == 1 and job["result"]["indexed"] == 2, outcomes
        [name] = refused
        assert "over the tenant's document quota: it holds 2 documents (max_documents = 2)" in \
            outcomes[name]["error"], outcomes[name]
        r = await http.post("/v1/search", json={"query": texts[name].decode(), "collection": "quota-a", "top_k": 5})
        assert name not in {h["filename"] for h in r.json()["hits"]}, r.text
        kept = next(n for n in texts if n != name)
        again = await upload(http, "quota-a", kept)  # held already: its job, or indexed again, never refused
        assert again["status"] == "completed", again
        elsewhere = await upload(http, "quota-b", "east.txt")
        assert elsewhere["status"] == "failed" and "max_documents = 2" in elsewhere["error"]["message"], elsewhere
        # Removed, a document no longer counts, and the refused one fits.
        r = await http.delete(f"/v1/documents/{outcomes[kept]['document_id']}")
        assert r.status_code == 202, r.text
        assert (await _wait(http, r.json()["job_id"]))["status"] == "completed"
        retried = await upload(http, "quota-a", name)
        assert retried["status"] == "completed", retried


async def test_a_tenants_upload_limit_bounds_the_body_before_it_is_read(stack):
    """A tenant limited to 1 MB a file may send at most 50 files of 1 MB (and the form around them): a
    longer body is refused from its Content-Length, not read and spooled up to the deployment's limit
    first. Another tenant's limit stays the deployment's."""
    tenant = f"small-{uuid.uuid4().hex[:8]}"
    path = stack.settings.effective_api_keys_file
    key = api_keys.create(path, tenant, "member", f"{tenant}-member")
    with path.open("a") as f:
        f.write(f"\n[tenants.{tenant}]\nmax_upload_mb = 1\n")
    length = 100 * 1024 * 1024  # over 50 x 1 MB, far under 50 x RAGLINE_MAX_UPLOAD_MB
    assert length < 50 * stack.settings.max_upload_mb * 1024 * 1024
    reads: list[dict] = []
    routed: list[str] = []

    async def receive() -> dict:
        reads.append({})
        return {"type": "http.request", "body": b"x" * 65536, "more_body": True}

    async def route(scope, receive, send) -> None:  # noqa: ANN001 - stands in for FastAPI, which reads it all
        routed.append(scope["path"])
        await send({"type": "http.response.start", "status": 202, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def post(api_key: str) -> list[dict]:
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        # The body limit as the app configures it (api/app.py), before the route.
        [configured] = [m for m in stack.app.user_middleware if m.cls is BodyLimit]
        limited = BodyLimit(route, **configured.kwargs)
        await limited({"type": "http", "method": "POST", "path": "/v1/documents", "headers": [
            (b"x-api-key", api_key.encode()), (b"content-length", str(length).encode()),
            (b"content-type", b"multipart/form-data; boundary=x")]}, receive, send)
        return sent

    sent = await post(key)
    assert sent[0]["status"] == 413 and (reads, routed) == ([], [])
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == "body_too_large" and "the tenant's max_upload_mb" in error["message"], error
    assert (await post(stack.keys["member"]))[0]["status"] == 202 and routed == ["/v1/documents"]

    # Over HTTP: the answer comes from the request's head alone (no body is sent at all).
    status, body = await _raw(stack, f"POST /v1/documents HTTP/1.1\nHost: x\nContent-Type: multipart/form-data; "
                                     f"boundary=b\nContent-Length: {length}\nX-API-Key: {key}\n")
    assert (status, body["error"]["code"]) == (413, "body_too_large")


async def test_a_tenant_page_limit_from_the_keys_file(stack):
    """`max_pages` in a tenant's table of the keys file caps the pages of its PDFs below the server's
    RAGLINE_MAX_PAGES: its PDF over the cap fails at extract_text with the reason, at once (no retries),
    and nothing of it is indexed, while a PDF at the cap is indexed; another tenant without a table
    (acme: the server's limit) has the very same PDF indexed."""
    tag = uuid.uuid4().hex[:8]
    tenant, collection = f"pages-{tag}", f"security-pages-{tag}"
    path = stack.settings.effective_api_keys_file
    key = api_keys.create(path, tenant, "member", f"{tenant}-member")
    with path.open("a") as f:
        f.write(f"\n[tenants.{tenant}]\nmax_pages = 2\n")
    assert stack.settings.max_pages > 3  # the server's own limit lets the 3-page PDF through
    three_pages = pdf_bytes([f"Page {n} of the {tag} harbour log lists the ships that came in." for n in (1, 2, 3)])
    two_pages = pdf_bytes([f"Page {n} of the {tag} lighthouse log lists the lamps that were lit." for n in (1, 2)])

    async with _client(stack, key) as http:
        r = await http.post("/v1/documents", data={"collection": collection},
                            files=[("files", ("log.pdf", three_pages))])
        assert r.status_code == 202, r.text
        refused = r.json()
        job = await _wait(http, refused["job_id"])
        assert job["status"] == "failed", job
        assert "too many pages: 3 > 2" in job["error"]["message"], job["error"]
        [document] = refused["documents"]
        doc_job = (await http.get(f"/v1/jobs/doc-{document['document_id']}")).json()
        extract = next(s for s in doc_job["steps"] if s["name"] == "extract_text")
        assert extract["status"] == "failed" and "too many pages: 3 > 2" in extract["error"], extract
        assert extract["attempts"] == 1, "a document over the limit must not burn retries"

        async def listed_as_failed() -> list[dict]:  # GET /v1/documents reads visibility, a moment behind
            docs = (await http.get("/v1/documents", params={"collection": collection})).json()["documents"]
            return docs if [(d["filename"], d["status"]) for d in docs] == [("log.pdf", "failed")] else []

        [listed] = await eventually(listed_as_failed, what="log.pdf listed as failed")
        assert listed["error"].startswith("too many pages: 3 > 2"), listed

        r = await http.post("/v1/documents", data={"collection": collection},
                            files=[("files", ("short.pdf", two_pages))])
        assert r.status_code == 202, r.text
        at_the_cap = await _wait(http, r.json()["job_id"])
        assert at_the_cap["status"] == "completed", at_the_cap
        assert at_the_cap["result"]["documents"][0]["pages"] == 2
    assert stack.index.count(tenant, collection, document["document_id"]) == 0

    # The same bytes from acme: the server's limit applies, the PDF is indexed, all three pages.
    mine = await stack.upload(("log.pdf", three_pages), collection=collection)
    job = await stack.wait_done(mine["job_id"])
    assert job["status"] == "completed", job
    [outcome] = job["result"]["documents"]
    assert outcome["status"] == "indexed" and outcome["pages"] == 3
    assert stack.index.count(stack.tenant, collection, outcome["document_id"]) == outcome["chunks"] > 0


# -- encrypted payloads ------------------------------------------------------------------------------

def _python() -> str:
    import sys
    return sys.executable


async def _workflow_show(stack, workflow_id: str, *extra: str) -> str:
    """`temporal workflow show` as a subprocess (async: the API it may call runs in this event loop)."""
    proc = await asyncio.create_subprocess_exec(
        temporal_binary(), "workflow", "show", "--address", stack.settings.temporal_address, "-w", workflow_id,
        "-o", "json", *extra, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    # Payload data is base64 in the JSON: read it as text, as the Web UI would show it.
    texts: list[str] = [out.decode()]

    def walk(node) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "data" and isinstance(v, str):
                    texts.append(base64.b64decode(v).decode("utf-8", "replace"))
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(json.loads(out))
    return "\n".join(texts)


async def test_histories_are_encrypted_and_readable_through_the_codec_endpoint(stack):
    tag = uuid.uuid4().hex[:8]
    secret = f"The {tag} vault code is kept in the blue cabinet."
    body = await stack.upload((f"{tag}.txt", secret.encode()), collection=f"enc-{tag}")
    await stack.wait_job(body["job_id"])
    question = f"Where is the {tag} vault code kept?"
    turn = await stack.chat(question, collection=f"enc-{tag}")
    done = await stack.wait_job(turn["job_id"])
    assert done["status"] == "completed"
    plain = await _workflow_show(stack, turn["job_id"])
    # Search attributes (the collection name here) stay readable; payloads do not.
    assert question not in plain and "blue cabinet" not in plain and "vault" not in plain
    assert base64.b64encode(b"binary/encrypted").decode() in plain
    decoded = await _workflow_show(stack, turn["job_id"], "--codec-endpoint", f"{stack.base_url}/codec",
                             "--codec-auth", f"Bearer {stack.keys['operator']}")
    assert question in decoded and "blue cabinet" in decoded


async def test_failure_messages_are_encrypted_and_the_api_shows_them(stack):
    """A reviewer's comment on a rejected answer is free text, and it fails the turn: Temporal keeps a failure's
    message and stack trace in its database and shows them in its Web UI. They are encrypted like the payloads
    (temporal/converter.py): the raw history and description say "Encoded failure", the API the reason."""
    collection, tag = f"fail-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex[:8]  # the collection is a search attribute
    body = await stack.upload(("herds.txt", b"The herds are counted from the air every spring."),
                              collection=collection)
    assert (await stack.wait_job(body["job_id"]))["status"] == "completed"
    comment = f"the {tag} census figures are confidential"
    r = await stack.http.post("/v1/chats", json={"message": "Who counts the herds?", "collection": collection,
                                                 "require_review": True})
    assert r.status_code == 202, r.text
    job_id, session_id = r.json()["job_id"], r.json()["session_id"]
    await waiting_reviews(stack, job_id)
    r = await stack.http.post(f"/v1/jobs/{job_id}/review",
                              json={"decision": "reject", "reviewer": "editor", "comment": comment})
    assert r.status_code == 200, r.text
    job = await stack.wait_done(job_id)
    assert (job["status"], job["error"]["message"]) == ("failed", f"answer rejected by editor: {comment}")
    # The turn's history and its session's (which records its child's failure), as Temporal stores them.
    raw, failures = await raw_temporal_records(stack.client, job_id, session_workflow_id(stack.tenant, session_id))
    assert tag.encode() not in raw and b"census" not in raw
    assert failures and all(f.message == "Encoded failure" and not f.stack_trace for f in failures), failures
    assert "census" not in await _workflow_show(stack, job_id)  # the CLI's view, as the Web UI's
    # The turn's own failure, as its history keeps it, reads through the codec.
    history = await stack.client.get_workflow_handle(job_id).fetch_history()
    [ended] = [e.workflow_execution_failed_event_attributes.failure for e in history.events
               if e.HasField("workflow_execution_failed_event_attributes")]
    assert await failure_message(stack.client, ended) == f"answer rejected by editor: {comment}"


async def test_a_callers_baggage_and_tracestate_stay_out_of_temporal(stack):
    """The tracing header of a job's history is not encrypted: it carries the request's trace, and nothing a
    caller adds to it (W3C `baggage` and `tracestate` are free text, an OpenTelemetry client's user id say)."""
    tag = uuid.uuid4().hex[:8]
    r = await stack.http.post("/v1/chats", json={"message": "Who counts the herds?", "collection": f"bag-{tag}"},
                              headers={"baggage": f"user.email=ana-{tag}@example.com", "tracestate": f"vendor=t{tag}"})
    assert r.status_code == 202, r.text
    body = r.json()
    job = await stack.wait_job(body["job_id"])
    assert job["status"] == "completed" and job["trace_id"], job
    raw, _ = await raw_temporal_records(stack.client, body["job_id"],
                                        session_workflow_id(stack.tenant, body["session_id"]))
    assert job["trace_id"].encode() in raw  # the request's trace goes on in the job
    carried = tag.encode() in raw.replace(f"bag-{tag}".encode(), b"")  # the collection is a search attribute
    assert not carried, "a caller's baggage or tracestate is in the job's history, unencrypted"


async def test_codec_endpoint_contract_cors_and_roles(stack, spans):
    origin = f"http://127.0.0.1:{stack.settings.temporal_ui_port}"
    payload = {"metadata": {"encoding": base64.b64encode(b"json/plain").decode()},
               "data": base64.b64encode(b'{"hello": "world"}').decode()}
    async with _client(stack, None) as http:
        pre = await http.options(f"/codec/k/{stack.keys['operator']}/decode", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,x-namespace"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == origin
        assert "x-namespace" in pre.headers["access-control-allow-headers"].lower()
        enc = await http.post(f"/codec/k/{stack.keys['operator']}/encode", json={"payloads": [payload]},
                              headers={"Origin": origin, "X-Namespace": "default"})
        assert enc.status_code == 200 and enc.headers["access-control-allow-origin"] == origin
        [sealed] = enc.json()["payloads"]
        assert base64.b64decode(sealed["metadata"]["encoding"]) == b"binary/encrypted"
        assert b"hello" not in base64.b64decode(sealed["data"])
        dec = await http.post("/codec/decode", json={"payloads": [sealed]},
                              headers={"X-API-Key": stack.keys["operator"], "X-Namespace": "default"})
        assert dec.json()["payloads"] == [payload]
        # The Web UI's key (role codec) decodes, and is refused everywhere else: every browser gets it.
        ui_key = api_keys.create(stack.settings.effective_api_keys_file, "acme", "codec", f"ui-{uuid.uuid4().hex[:6]}")
        ui = await http.post(f"/codec/k/{ui_key}/decode", json={"payloads": [sealed]}, headers={"Origin": origin})
        assert ui.status_code == 200 and ui.json()["payloads"] == [payload], ui.text
        for method, path in (("GET", "/v1/jobs"), ("GET", "/v1/reviews"), ("POST", "/v1/dead-letters/retry")):
            r = await http.request(method, path, headers={"X-API-Key": ui_key}, json={} if method == "POST" else None)
            assert (r.status_code, r.json()["error"]["code"]) == (403, "forbidden"), (path, r.text)
        # A payload that is not encrypted (the tracing header in a history) is shown as it is, so the
        # Web UI and the CLI can show whole histories; the worker's own decoding refuses it as input.
        shown = await http.post("/codec/decode", json={"payloads": [payload]},
                                headers={"X-API-Key": stack.keys["operator"]})
        assert shown.status_code == 200 and shown.json()["payloads"] == [payload]
        codec = stack.client.data_converter.payload_codec
        [refused] = await codec.decode([json_format.ParseDict(payload, Payload())])
        assert refused.metadata["encoding"] == codec_mod.UNENCRYPTED  # no converter reads it
        with pytest.raises(ApplicationError, match="came unencrypted") as unread:
            stack.client.data_converter.payload_converter.from_payloads([refused])
        assert unread.value.type == "NotEncrypted"
        # A member or no key gets nothing, and neither does a tenant's reviewer: the payload keys are the
        # deployment's, so the codec would show it every other tenant's prompts and answers.
        assert (await http.post(f"/codec/k/{stack.keys['member']}/decode", json={"payloads": [sealed]})).status_code == 403
        for key in (stack.keys["reviewer"], stack.keys["other"]):
            refused = await http.post("/codec/decode", json={"payloads": [sealed]}, headers={"X-API-Key": key})
            assert (refused.status_code, refused.json()["error"]["code"]) == (403, "forbidden")
            assert "operator key" in refused.json()["error"]["message"]
        assert (await http.post("/codec/decode", json={"payloads": [sealed]})).status_code == 401
        assert (await http.post("/codec/k/rgl_wrong/decode", json={"payloads": [sealed]})).status_code == 401
        evil = await http.options("/codec/decode", headers={"Origin": "http://evil.example",
                                                           "Access-Control-Request-Method": "POST"})
        assert evil.headers.get("access-control-allow-origin") != "http://evil.example"
    # The key in the Web UI's codec path is a secret: the API's traces do not record it.
    assert not [s for s in spans.get_finished_spans()
                if s.kind == SpanKind.SERVER and stack.keys["operator"] in str(dict(s.attributes or {}))]


async def test_a_decision_sent_by_hand_without_the_codec_is_dropped_and_the_job_goes_on(stack):
    """`temporal workflow signal` without the codec flags sends the decision in plain JSON: the job never
    takes it, and neither wedges (its workflow task failing on every retry) nor answers decisions sent
    the right way with a false `job_closed`."""
    with stack.llm.scope() as llm:
        r = await stack.http.post("/v1/chats", json={"message": f"Which channel does the red buoy mark? {llm.token}",
                                                     "collection": "plain-signal", "require_review": True})
        job_id = r.json()["job_id"]
        await waiting_reviews(stack, job_id)
    plain = await Client.connect(stack.client.service_client.config.target_host, namespace=stack.client.namespace)
    handle = stack.client.get_workflow_handle(job_id)
    await plain.get_workflow_handle(job_id).signal("review", {"decision": "reject", "reviewer": "mallory"})

    async def handled() -> bool:  # a workflow task of the job has run since the signal came
        events = [e.event_type for e in (await handle.fetch_history()).events]
        signalled = events.index(EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED)
        return EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED in events[signalled:] or \
            EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED in events[signalled:]
    await eventually(handled, what="the job's worker handling the plain signal")
    events = [e.event_type for e in (await handle.fetch_history()).events]
    assert EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED not in events
    # The same decision as an Update (`temporal workflow update execute` without the codec flags) is refused
    # with what to do, readable without the codec (it read "Encoded failure (type: KeyError)").
    with pytest.raises(WorkflowUpdateFailedError) as refused:
        await plain.get_workflow_handle(job_id).execute_update("review", {"decision": "reject", "reviewer": "mallory"})
    causes = []
    cause = refused.value.cause
    while cause is not None:
        causes.append(cause)
        cause = cause.__cause__
    told = [c for c in causes if isinstance(c, ApplicationError) and c.type == "NotEncrypted"]
    assert told and "--codec-endpoint" in told[0].message, [repr(c) for c in causes]
    assert (await stack.http.get(f"/v1/jobs/{job_id}")).json()["status"] == "waiting_review"
    r = await stack.http.post(f"/v1/jobs/{job_id}/review", json={"decision": "approve", "reviewer": "editor"})
    assert r.status_code < 300, r.text
    job = await stack.wait_done(job_id)
    assert job["status"] == "completed" and job["result"]["review"]["reviewer"] == "editor", job


async def test_a_decision_to_a_job_whose_workflow_task_keeps_failing_says_so(scripted_llm, tmp_path):
    """A signal encrypted with a key the workers lack fails the job's workflow task on every retry (an
    operator's matter: the keys files differ). A decision sent then is refused as `job_stuck`, not with
    a false `job_closed`. On a Temporal server of its own: a history no key reads stops every blob sweep of
    its namespace, as it should, and the shared stack's sweeps are other tests' business."""
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), search_attributes=list(sa.ALL),
        dev_server_startup_timeout=SERVER_STARTUP)
    address = env.client.service_client.config.target_host
    try:
        async with running_stack(address, scripted_llm, tmp_path, task_queue="ragline-stuck") as stack:
            with stack.llm.scope() as llm:
                r = await stack.http.post("/v1/chats", json={"message": f"Is the harbour open? {llm.token}",
                                                             "collection": "stuck-review", "require_review": True})
                job_id = r.json()["job_id"]
                await waiting_reviews(stack, job_id)
            foreign = codec_mod.EncryptionCodec(codec_mod.CodecKeys(current="k-x", keys={"k-x": bytes(32)}))
            other = await Client.connect(address, data_converter=dataclasses.replace(DataConverter.default,
                                                                                     payload_codec=foreign))
            await other.get_workflow_handle(job_id).signal("review", {"decision": "reject", "reviewer": "mallory"})

            async def refused_as_stuck() -> dict | None:
                r = await stack.http.post(f"/v1/jobs/{job_id}/review", json={"decision": "approve", "reviewer": "ed"})
                return r.json()["error"] if r.status_code == 409 and r.json()["error"]["code"] == "job_stuck" else None
            error = await eventually(refused_as_stuck, what="the review refused as job_stuck")
            assert "workflow task keeps failing" in error["message"] and error["job_id"] == job_id, error
            # Its review still waits: the list says it cannot read it now, rather than leave it out.
            listed = (await stack.http.get("/v1/reviews")).json()
            assert listed["unreadable"] == [job_id] and listed["reviews"] == [], listed
            await stack.client.get_workflow_handle(job_id).terminate("test: stuck on a foreign key")
    finally:
        await env.shutdown()


async def test_a_job_encrypted_with_a_key_this_api_lacks_gets_a_clear_error(stack, tmp_path):
    """A deployment whose processes do not share one codec keys file: the API says what is wrong
    (500 `payload_unreadable`, JSON, naming the setting) instead of failing with a bare 500. The job
    belongs to a tenant of this test's own: unreadable, it would otherwise stay listed for the shared
    tenant, and tests/test_contract.py's fuzzer would operate it and get this very 500."""
    tenant = f"unreadable-{uuid.uuid4().hex[:8]}"
    key = api_keys.create(stack.settings.effective_api_keys_file, tenant, "reviewer", f"{tenant}-reviewer")
    elsewhere = await connect(stack.settings.model_copy(update={"codec_keys_file": tmp_path / "other_keys.toml"}))
    job_id = f"{tenant}.chat-{uuid.uuid4().hex}.{'0' * 20}"
    try:
        await elsewhere.start_workflow(
            "ChatTurnWorkflow", id=job_id, task_queue=f"nobody-{uuid.uuid4().hex[:8]}", memo={"turn": 1},
            search_attributes=TypedSearchAttributes([SearchAttributePair(sa.JOB_KIND, "chat"),
                                                     SearchAttributePair(sa.JOB_STATUS, "queued"),
                                                     SearchAttributePair(sa.TENANT, tenant)]))
        async with _client(stack, key) as http:
            r = await http.get(f"/v1/jobs/{job_id}")
            assert r.status_code == 500, r.text
            error = r.json()["error"]
            assert error["code"] == "payload_unreadable" and "RAGLINE_CODEC_KEYS_FILE" in error["message"]
            # ... as the API's description of the route says it may.
            route = (await http.get("/openapi.json")).json()["paths"]["/v1/jobs/{job_id}"]["get"]
            assert "payload_unreadable" in route["responses"]["default"]["description"]
    finally:
        await _end_jobs(stack.client, job_id)
        # Its history no key of the stack reads would stop every later blob sweep of the namespace.
        await stack.client.workflow_service.delete_workflow_execution(DeleteWorkflowExecutionRequest(
            namespace=stack.client.namespace, workflow_execution=WorkflowExecution(workflow_id=job_id)))

        async def gone() -> bool:
            try:
                await stack.client.get_workflow_handle(job_id).describe()
            except RPCError as exc:
                return exc.status == RPCStatusCode.NOT_FOUND
            return False
        await eventually(gone, what=f"{job_id} deleted")


async def test_keys_rotate_and_old_payloads_stay_readable(tmp_path):
    path = tmp_path / "codec.toml"
    first = codec_mod.load_or_create(path)
    assert path.stat().st_mode & 0o777 == 0o600
    old = codec_mod.EncryptionCodec(first)
    [sealed] = await old.encode([Payload(metadata={"encoding": b"json/plain"}, data=b'"secret"')])
    new_id = codec_mod.rotate(path)
    rotated = codec_mod.load_keys(path)
    assert rotated.current == new_id != first.current and set(rotated.keys) == {new_id, first.current}
    new = codec_mod.EncryptionCodec(rotated)
    [fresh] = await new.encode([Payload(metadata={"encoding": b"json/plain"}, data=b'"secret"')])
    assert fresh.metadata["encryption-key-id"] == new_id.encode()
    [opened] = await new.decode([sealed])
    assert opened.data == b'"secret"'
    # Without the old key the old payload cannot be read; tampering is detected.
    only_new = codec_mod.EncryptionCodec(codec_mod.CodecKeys(current=new_id, keys={new_id: rotated.keys[new_id]}))
    with pytest.raises(codec_mod.CodecError, match="unknown key"):
        await only_new.decode([sealed])
    tampered = Payload(metadata=dict(fresh.metadata), data=fresh.data[:-1] + bytes([fresh.data[-1] ^ 1]))
    with pytest.raises(codec_mod.CodecError, match="tampered"):
        await new.decode([tampered])


async def test_a_process_started_before_a_rotation_reads_what_one_started_after_it_writes(tmp_path):
    """`rotate` makes the new key current at once; an API or a worker that has not restarted since (a
    worker the supervisor restarted after a crash, one API pod of several) reads the keys file again when it
    meets the new key, instead of failing every view (500) or every workflow task of the new jobs."""
    from api.cursors import CursorSigner
    from api.errors import ApiError

    path = tmp_path / "codec.toml"
    running = codec_mod.EncryptionCodec(codec_mod.KeysFile(path))
    running_api = CursorSigner.for_deployment(path)
    codec_mod.rotate(path)
    restarted = codec_mod.EncryptionCodec(codec_mod.KeysFile(path))
    [sealed] = await restarted.encode([Payload(metadata={"encoding": b"json/plain"}, data=b'"turn"')])
    [opened] = await running.decode([sealed])
    assert opened.data == b'"turn"'
    [again] = await running.encode([Payload(metadata={"encoding": b"json/plain"}, data=b'"next"')])
    assert again.metadata["encryption-key-id"] == sealed.metadata["encryption-key-id"]  # and writes with it
    cursor = CursorSigner.for_deployment(path).encode("tenant=acme", b"page-token")
    assert running_api.decode("tenant=acme", cursor) == b"page-token"
    with pytest.raises(ApiError, match="cursor"):
        running_api.decode("tenant=globex", cursor)


async def test_a_process_started_before_a_rotation_writes_with_the_new_key_soon_after(tmp_path, monkeypatch):
    """Every process of a running deployment predates a rotation: none meets a payload under the new key, so
    each must look at the file as it writes, or it writes with the old key until restarted (and once the old
    key is dropped, as README says, processes started since cannot read what the others wrote)."""
    from api.cursors import CursorSigner

    path = tmp_path / "codec.toml"
    running = codec_mod.EncryptionCodec(codec_mod.KeysFile(path))
    running_api = CursorSigner.for_deployment(path)
    plain = Payload(metadata={"encoding": b"json/plain"}, data=b'"turn"')
    [before] = await running.encode([plain])
    new_id = codec_mod.rotate(path)
    monkeypatch.setattr(codec_mod.KeysFile, "CHECK_EVERY", 0.0)  # a few seconds on
    [after] = await running.encode([plain])
    assert before.metadata["encryption-key-id"] != after.metadata["encryption-key-id"] == new_id.encode()
    # The old key dropped: a process started now reads what the running one writes, and its cursors.
    keys = codec_mod.load_keys(path)
    codec_mod._write(path, codec_mod.CodecKeys(current=new_id, keys={new_id: keys.keys[new_id]}), exclusive=False)
    cursor = running_api.encode("tenant=acme", b"page-token")
    started_now = codec_mod.EncryptionCodec(codec_mod.KeysFile(path))
    [opened] = await started_now.decode([after])
    assert opened.data == b'"turn"'
    assert CursorSigner.for_deployment(path).decode("tenant=acme", cursor) == b"page-token"
    # A hand edit under way (not TOML yet) leaves the running process writing with the keys it has.
    path.write_text("current = ")
    [during] = await running.encode([plain])
    assert during.metadata["encryption-key-id"] == new_id.encode()


# -- sensitive data ----------------------------------------------------------------------------------

def test_a_hosted_fallback_of_a_local_model_gets_masked_text(tmp_path):
    """RAGLINE_LLM_LOCAL=true says the main model is local; the hosted fallback is not, and gets masked text."""
    settings = Settings(data_dir=tmp_path, redact_pii=True, llm_local=True, llm_base_url="http://gpu-box.lan:8080/v1",
                        fallback_llm_base_url="https://api.example.com/v1")
    messages = [{"role": "user", "content": "Write to jane@example.com"}]
    assert ChatModel(settings)._mask(messages) == messages
    assert "jane@example.com" not in str(fallback_model(settings)._mask(messages))
    # The local one's side steps are read as streams (a cancel stops its generation); the hosted one's not.
    assert ChatModel(settings).whole_replies_streamed and not fallback_model(settings).whole_replies_streamed


async def test_collection_names_starting_with_an_underscore_are_refused(stack):
    """They are Ragline's own: `_meta` would have been the collection that holds every collection's version."""
    r = await stack.http.post("/v1/documents", data={"collection": "_meta"}, files=[("files", ("a.txt", b"hello"))])
    assert r.status_code == 422, r.text
    for path, body in (("/v1/search", {"query": "hello", "collection": "_meta"}),
                       ("/v1/chats", {"message": "hello", "collection": "_meta"})):
        r = await stack.http.post(path, json=body)
        assert r.status_code == 422 and "collection" in r.text, (path, r.text)
    assert (await stack.http.get("/v1/documents", params={"collection": "_meta"})).status_code == 422


def test_redaction_masks_phones_emails_and_id_numbers():
    assert redact("call 13812345678 or +1 (555) 123-4567") == "call 138****5678 or 155****4567"
    assert redact("mail ana.b@example.co.uk") == "mail [email]"
    assert redact("ID 11010519491231002X, SSN 123-45-6789") == "ID [id], SSN [id]"
    assert redact("in 2023-2024 revenue grew 15% over 12 months") == "in 2023-2024 revenue grew 15% over 12 months"


async def test_text_sent_to_a_remote_model_and_logs_are_masked(scripted_llm, tmp_path, capsys):
    token = f"tok{uuid.uuid4().hex[:8]}"
    secret = f"{token} Reach Ana at 13812345678 or ana@example.com, ID 11010519491231002X."
    remote = ChatModel(Settings(data_dir=tmp_path, llm_base_url=scripted_llm.base_url, llm_model="scripted",
                                redact_pii=True, llm_local=False))
    local = ChatModel(Settings(data_dir=tmp_path, llm_base_url=scripted_llm.base_url, llm_model="scripted",
                               redact_pii=True))
    try:
        await remote.complete([{"role": "user", "content": secret}], step="test")
        await local.complete([{"role": "user", "content": secret + " local"}], step="test")
    finally:
        await remote.close()
        await local.close()
    sent = [c.text for c in scripted_llm.calls if token in c.text]
    remote_text = next(t for t in sent if "local" not in t)
    assert "13812345678" not in remote_text and "ana@example.com" not in remote_text
    assert "138****5678" in remote_text and "[email]" in remote_text and "[id]" in remote_text
    assert "13812345678" in next(t for t in sent if "local" in t)  # a local model sees the text as is

    import structlog
    logs.configure("INFO", json=True, redact=True)
    try:
        structlog.get_logger("t").info("question", text=secret)
        logging.getLogger("t").warning("plain %s", secret)
    finally:
        logs.configure("INFO", json=False)
        for handler in logging.getLogger().handlers:
            handler.filters = [f for f in handler.filters if type(f).__name__ != "RedactingFilter"]
    out = capsys.readouterr()
    text = out.out + out.err
    assert token in text and "13812345678" not in text and "ana@example.com" not in text


async def _wait(http: httpx.AsyncClient, job_id: str, timeout: float = 120) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        job = (await http.get(f"/v1/jobs/{job_id}")).json()
        if job["status"] in ("completed", "failed", "dead_lettered", "waiting_review", "cancelled"):
            return job
        assert loop.time() < deadline, job
        await asyncio.sleep(0.2)


async def test_an_unknown_route_or_method_has_a_stable_error_code(stack):
    r = await stack.http.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = await stack.http.delete("/v1/chats")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert r.headers["allow"] == "POST"


def test_the_audit_log_reads_while_an_entry_is_being_appended(tmp_path):
    """Another request's entry half written when a reader looks (an append does not hold readers off):
    the entries before it are read, that one on the next read, once whole."""
    settings = Settings(data_dir=tmp_path)
    first = audit.record(settings, action="review", tenant="acme", key="k1", key_name="ci", job_id="acme.a",
                         outcome="accepted")
    line = (tmp_path / "audit.log").read_text()
    with (tmp_path / "audit.log").open("a") as f:
        f.write(line[: len(line) // 2])
    assert audit.read(settings) == [first]
    with (tmp_path / "audit.log").open("a") as f:
        f.write(line[len(line) // 2:])
    assert audit.read(settings) == [first, first]


def test_the_audit_log_goes_where_ragline_audit_log_says(tmp_path, capsys):
    """Unset: <data_dir>/audit.log. A path: that file (on a cluster, one per pod on a shared volume), its
    folder made if missing. `-`: one JSON line per entry on standard output, for the cluster's log
    pipeline, written whatever the log level, and nothing under the data folder."""
    entry = {"action": "cancel", "tenant": "acme", "key": "k1", "key_name": "ci", "job_id": "acme.a",
             "outcome": "accepted"}
    data = tmp_path / "data"
    default = Settings(data_dir=data)
    assert default.audit_log_file == data / "audit.log"
    written = audit.record(default, **entry)
    assert audit.read(default) == [written]

    elsewhere = Settings(data_dir=data, audit_log=str(tmp_path / "shared" / "audit" / "api-7f9c-x2.log"))
    there = audit.record(elsewhere, **entry, reason="moved")
    assert audit.read(elsewhere) == [there]
    assert audit.read(default) == [written]  # not in the data folder's file

    logs.configure("WARNING", json=True)  # an audit entry is not a log line a level filters out
    try:
        capsys.readouterr()
        to_stdout = Settings(data_dir=tmp_path / "other", audit_log="-")
        assert to_stdout.audit_log_file is None
        printed = audit.record(to_stdout, **entry, reason="stuck")
        structlog.get_logger("test").warning("a log line beside the entry")  # on standard error, not in it
        out = capsys.readouterr()
    finally:
        logs.configure("INFO", json=False)
    assert [json.loads(line) for line in out.out.splitlines()] == [printed]
    assert printed["reason"] == "stuck" and "stuck" not in out.err  # once: not in the API log as well
    assert "a log line beside the entry" in out.err
    assert not (tmp_path / "other").exists()
    with pytest.raises(ValueError, match="standard output"):
        audit.read(to_stdout)


def test_one_tenants_uploads_do_not_change_how_anothers_passages_score_for_a_term():
    """The lexical half of retrieval weighs a term by how rare it is (BM25's IDF). Counted over the whole
    collection, another tenant's uploads changed which of this tenant's passages ranked first for it (and so
    told a little of what others store), and so did chunks still pending; counted over the tenant's own
    searchable passages, they do not."""
    from qdrant_client import QdrantClient

    from ragline.vectorstore import LEXICAL, ChunkPoint, VectorIndex

    index = VectorIndex(QdrantClient(":memory:"), 4, embedded=True)

    def upload(tenant: str, document_id: str, texts: list[str], *, publish: bool = True) -> None:
        index.upsert(tenant, "c", [ChunkPoint(document_id, i, [1.0, 0.0, 0.0, 0.0], {
            "document_id": document_id, "filename": f"{tenant}.txt", "collection": "c", "page": 1, "chunk": i,
            "text": text}) for i, text in enumerate(texts)])
        if publish:
            index.publish(tenant, "c", document_id, len(texts))

    sent = []
    batch = index.client.query_batch_points
    index.client.query_batch_points = lambda name, requests, **kw: sent.append((name, requests)) or batch(
        name, requests=requests, **kw)

    def lexical_scores() -> dict[str, float]:
        """The lexical request the search sent, as Qdrant scores it now."""
        sent.clear()
        index.search("acme", "c", [1.0, 0.0, 0.0, 0.0], 3, text="copper brass")
        [(name, requests)] = sent
        [lexical] = [r for r in requests if r.using == LEXICAL]
        return {p.payload["text"]: round(p.score, 6) for p in batch(name, requests=[lexical])[0].points}

    upload("acme", "a" * 32, ["the copper kettle whistles", "the brass valve leaks", "the brass pipe bends"])
    alone = lexical_scores()
    # The tenant's own chunks still being indexed are found by nothing yet: they count for nothing either.
    upload("acme", "c" * 32, [f"brass screw {i}" for i in range(30)], publish=False)
    assert lexical_scores() == alone
    index.remove_pending("acme", "c", "c" * 32)
    upload("globex", "b" * 32, [f"copper wire number {i}" for i in range(60)])
    upload("acme", "d" * 32, [f"brass screw {i}" for i in range(30)], publish=False)
    assert lexical_scores() == alone
    index.publish("acme", "c", "d" * 32, 30)  # once found, they count
    assert lexical_scores() != alone


def test_an_action_that_fails_after_reaching_temporal_is_audited_as_unknown_not_refused(tmp_path):
    """A refusal (4xx) did nothing; a failure after the request reached Temporal (its answer unreadable, a
    timeout) may have been applied: the trail must not say it was refused."""
    from api.errors import ApiError
    from ragline import audit
    from ragline.settings import Settings

    settings = Settings(data_dir=tmp_path)
    who = {"tenant": "acme", "key": "k", "key_name": "ops", "job_id": "acme.chat-1"}
    from temporalio.service import RPCError, RPCStatusCode

    for error in (ApiError(409, "not_dead_lettered", "no"), RuntimeError("answer unreadable"),
                  RPCError("connection reset", RPCStatusCode.UNAVAILABLE, b"")):
        with pytest.raises(type(error)), audit.recorded(settings, action="retry", **who):
            raise error
    assert [e["outcome"] for e in audit.read(settings)] == [
        "refused: not_dead_lettered", "unknown: RuntimeError", "unknown: RPCError"]
