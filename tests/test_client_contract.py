"""What a client written from README.md and /openapi.json alone meets: every refusal has a documented status
and code, names what was wrong, and the documents describe what the API really sends. (schemathesis,
tests/test_contract.py, checks the shapes; these are the cases it does not generate.)"""

from __future__ import annotations

import pytest

from tests.helpers import read_events

pytestmark = pytest.mark.timeout(120)


def _documented(spec: dict, path: str, method: str, status: int) -> str:
    return spec["paths"][path][method]["responses"][str(status)]["description"]


async def test_a_multipart_body_that_does_not_parse_is_a_documented_422(stack):
    spec = (await stack.http.get("/openapi.json")).json()
    for content_type in ("multipart/form-data", "multipart/form-data; boundary=zz"):
        r = await stack.http.post("/v1/documents", content=b"x" * 100, headers={"content-type": content_type})
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_request"
        assert error["code"] in _documented(spec, "/v1/documents", "post", 422)
        assert "multipart" in error["message"].lower(), error  # says what did not read


async def test_an_upload_sent_as_json_is_the_415_its_route_documents(stack):
    r = await stack.http.post("/v1/documents", json={"files": []})
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_media_type"
    spec = (await stack.http.get("/openapi.json")).json()
    described = _documented(spec, "/v1/documents", "post", 415)
    assert "unsupported_media_type" in described and "unsupported_file_type" in described, described


@pytest.mark.parametrize("path, params", [
    ("/v1/jobs", {"stauts": "failed"}),
    ("/v1/documents", {"colection": "default"}),
    ("/v1/evaluations", {"limt": "5"}),
    ("/v1/reviews", {"status": "waiting_review"}),
])
async def test_a_query_parameter_the_route_does_not_take_is_refused_by_name(stack, path, params):
    r = await stack.http.get(path, params=params)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_request"
    name = next(iter(params))
    assert name in error["message"] and error["problems"] == [
        {"field": f"query.{name}", "message": "unknown query parameter"}]


async def test_a_body_field_sent_in_the_query_is_told_where_it_goes(stack):
    """`POST /v1/documents?collection=x` would have put the files in `default`: the refusal says where it goes."""
    r = await stack.http.post("/v1/documents?collection=elsewhere", files={"files": ("a.txt", b"Some text.")})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["message"] == "collection goes in the request body (a form field), not in the query"
    r = await stack.http.post("/v1/chats?message=hi", json={"message": "Hello?"})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["problems"] == [{"field": "query.message", "message": "send it as a JSON field"}]


async def test_a_query_parameter_sent_twice_is_refused_and_one_sent_once_is_taken(stack):
    r = await stack.http.get("/v1/jobs?status=running&status=completed")
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "invalid_request" and "status" in r.json()["error"]["message"]
    r = await stack.http.get("/v1/jobs", params={"status": "completed", "kind": "chat", "limit": 1})
    assert r.status_code == 200, r.text


async def test_a_post_with_an_unknown_query_parameter_starts_nothing(stack):
    before = (await stack.http.get("/v1/jobs", params={"kind": "chat", "limit": 1000})).json()["jobs"]
    r = await stack.http.post("/v1/chats", params={"colection": "other"}, json={"message": "hello there"})
    assert r.status_code == 422, r.text
    assert "colection" in r.json()["error"]["message"]
    after = (await stack.http.get("/v1/jobs", params={"kind": "chat", "limit": 1000})).json()["jobs"]
    assert {j["job_id"] for j in after} == {j["job_id"] for j in before}


async def test_a_key_is_checked_before_the_query(stack):
    r = await stack.http.get("/v1/jobs", params={"stauts": "failed"}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401, r.text


@pytest.mark.parametrize("body, says", [(b"", "no body"), (b"[]", "JSON object"), (b"null", "JSON object")])
async def test_a_json_body_missing_or_not_an_object_is_named_body(stack, body, says):
    r = await stack.http.post("/v1/chats", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_request"
    assert [p["field"] for p in error["problems"]] == ["body"]
    assert error["message"].startswith("body: ") and says in error["message"], error


async def test_the_evaluation_routes_document_what_they_answer(stack):
    spec = (await stack.http.get("/openapi.json")).json()
    r = await stack.http.get("/v1/evaluations", params={"limit": "ten"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"
    assert "invalid_request" in _documented(spec, "/v1/evaluations", "get", 422)
    assert _documented(spec, "/v1/evaluations", "post", 202).startswith("Accepted")


async def test_the_documented_event_schema_names_the_traceparent_every_event_carries(stack):
    spec = (await stack.http.get("/openapi.json")).json()
    stream = spec["paths"]["/v1/jobs/{job_id}/events"]["get"]["responses"]["200"]["content"]["text/event-stream"]
    documented = stream["itemSchema"]["properties"]["data"]["contentSchema"]["properties"]
    accepted = await stack.chat("what does the contract say about events?")
    events = [event for _, event in await read_events(stack, accepted["job_id"])]
    assert events and all(set(event) <= set(documented) for event in events), (set(events[0]) - set(documented))
    assert all(event["traceparent"] for event in events)


async def test_a_file_sent_under_another_field_name_is_named_as_such(stack):
    r = await stack.http.post("/v1/documents", files=[("file", ("notes.txt", b"some text long enough to index"))])
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_request" and error["fields"] == ["file"], error
    assert "unknown form field(s): file" in error["message"]


@pytest.mark.parametrize("number", ["NaN", "Infinity"])
async def test_an_agent_budget_that_is_no_number_is_told_so(stack, number):
    body = '{"goal": "compare the costs", "budget": {"max_seconds": %s}}' % number
    r = await stack.http.post("/v1/agents", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_request" and "finite number" in error["message"], error


async def test_a_stream_resumes_from_the_last_event_id_an_eventsource_polyfill_sends_in_the_query(stack):
    # A browser sends the key in a header only through a polyfill (EventSource cannot), and the common one
    # sends the last id as ?lastEventId= on a reconnect: taken, not refused as an unknown parameter.
    accepted = await stack.chat("what does the contract say about reconnecting?")
    events = await read_events(stack, accepted["job_id"])
    assert len(events) >= 3
    r = await stack.http.get(f"/v1/jobs/{accepted['job_id']}/events", params={"lastEventId": events[-3][0]})
    assert r.status_code == 200, r.text
    ids = [line[3:].strip() for line in r.text.splitlines() if line.startswith("id:")]
    assert ids == [event_id for event_id, _ in events[-2:]]
