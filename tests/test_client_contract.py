"""What a client written from README.md and /openapi.json alone meets: every refusal has a documented status
and code, names what was wrong, and the documents describe what the API really sends. (schemathesis,
tests/test_contract.py, checks the shapes; these are the cases it does not generate.)"""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize("body, says", [(b"", "no body"), (b"[]", "JSON object"), (b"null", "JSON object")])
async def test_a_json_body_missing_or_not_an_object_is_named_body(stack, body, says):
    r = await stack.http.post("/v1/chats", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_request"
    assert [p["field"] for p in error["problems"]] == ["body"]
    assert error["message"].startswith("body: ") and says in error["message"], error
