"""The codec server for the Temporal Web UI and CLI: POST /codec/encode and /codec/decode.

The contract is Temporal's: a JSON body `{"payloads": [{"metadata": {...base64}, "data": "<base64>"}]}`,
the same shape back; the callers send `X-Namespace`. Only operator and codec keys may use it: it turns
ciphertext into prompts, passages and answers, of every tenant (the payload keys are the deployment's).

How the caller authenticates:
  - the CLI sends a header: `temporal workflow show --codec-endpoint http://API/codec
    --codec-auth "Bearer <operator key>"` (or `--codec-header X-API-Key=<key>`);
  - the Web UI cannot add headers (`temporal server start-dev` has no flag for it), so its endpoint
    carries the key in the path: `--ui-codec-endpoint http://API/codec/k/<codec key>`. `make run`
    creates a fresh codec key (role `codec`: this endpoint and nothing else) for this at every start
    (name `webui-codec`), so the key the UI hands browsers dies with it; the API's access log shows that
    path as `/codec/k/***`.

A body is read only after the key check, and only up to RAGLINE_CODEC_MAX_BODY_MB (413 `body_too_large`:
from its Content-Length, or once one sent without a length passes it), so a caller cannot have the API
hold a body of any size in memory.

It is a sub-application mounted at /codec, so that CORS (for the Web UI's origin, with the
X-Namespace header, preflight included) applies to it alone.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from fastapi import FastAPI, Header, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from google.protobuf import json_format
from temporalio.api.common.v1 import Payload, Payloads
from temporalio.converter import PayloadCodec

from api import errors
from api.auth import Guard, admit
from api.errors import ApiError
from api.limits import Cap, too_large
from ragline import tracing
from ragline.settings import Settings
from temporal.codec import ENCODING

KEY_IN_PATH = re.compile(r"/codec/k/[^/\s]+")


def create_codec_app(settings: Settings, guard: Guard, get_codec: Callable[[], PayloadCodec | None]) -> FastAPI:
    app = FastAPI(title="Ragline codec server", openapi_url=None, docs_url=None, redoc_url=None,
                  telemetry=tracing.FASTAPI_NATIVE_TELEMETRY_OFF)
    app.state.guard = guard
    errors.install(app)
    app.add_middleware(CORSMiddleware, allow_origins=settings.effective_codec_cors_origins,
                       allow_methods=["POST", "OPTIONS"], allow_credentials=True,
                       allow_headers=["Content-Type", "X-Namespace", "Authorization", "X-API-Key"])

    async def operator(request: Request, path_key: str | None) -> None:
        key = path_key or request.headers.get("x-api-key")
        auth = request.headers.get("authorization", "")
        if not key and auth.lower().startswith("bearer "):
            key = auth[7:].strip()
        if not key:
            raise ApiError(401, "unauthenticated", "the codec endpoint needs an operator key",
                           headers={"WWW-Authenticate": "Bearer"})
        caller = await admit(request, key)
        if not caller.may_use_codec:  # a tenant's reviewer would read every other tenant's payloads
            raise ApiError(403, "forbidden", "the codec endpoint needs an operator key (it reads every tenant's "
                                             "payloads)")

    async def run(request: Request, action: str, path_key: str | None, namespace: str | None) -> Response:
        await operator(request, path_key)
        codec = get_codec()
        if codec is None:
            raise ApiError(404, "encryption_off", "payload encryption is off (RAGLINE_ENCRYPT_PAYLOADS)")
        if namespace and namespace != settings.temporal_namespace:
            raise ApiError(400, "wrong_namespace", f"this codec serves namespace {settings.temporal_namespace!r}")
        body = await _body(request, Cap(settings.codec_max_body_bytes, "RAGLINE_CODEC_MAX_BODY_MB"))
        try:
            payloads = json_format.Parse(body, Payloads(), ignore_unknown_fields=True)
        except Exception as exc:
            raise ApiError(400, "invalid_payloads", f"not a payloads object: {exc}") from None
        try:
            if action == "encode":
                out = Payloads(payloads=await codec.encode(list(payloads.payloads)))
            else:
                out = Payloads(payloads=[await _decode_for_display(codec, p) for p in payloads.payloads])
        except Exception as exc:
            raise ApiError(400, "codec_error", str(exc)) from None
        return Response(json_format.MessageToJson(out), media_type="application/json")

    for action in ("encode", "decode"):
        def make(action: str):
            async def with_header(request: Request, x_namespace: str | None = Header(None)) -> Response:
                return await run(request, action, None, x_namespace)

            async def with_path_key(key: str, request: Request, x_namespace: str | None = Header(None)) -> Response:
                return await run(request, action, key, x_namespace)
            return with_header, with_path_key

        with_header, with_path_key = make(action)
        app.post(f"/{action}")(with_header)
        app.post(f"/k/{{key}}/{action}")(with_path_key)

    return app


async def _body(request: Request, cap: Cap) -> bytes:
    """The request's body, refused (413) from its Content-Length when that is over `cap`, and otherwise
    read only up to `cap` (a body sent without a length, or longer than it said)."""
    length = (request.headers.get("content-length") or "").strip()  # the server keeps trailing spaces
    if length and (not length.isdigit() or int(length) > cap.bytes):
        raise too_large(cap)
    body = bytearray()  # one buffer: not the chunks and their join besides
    async for chunk in request.stream():
        if len(body) + len(chunk) > cap.bytes:
            raise too_large(cap)
        body += chunk
    return bytes(body)


async def _decode_for_display(codec: PayloadCodec, payload: Payload) -> Payload:
    """Decrypt what is encrypted and show the rest as it is. Histories also hold payloads that are not
    ours to encrypt (the tracing header, which Temporal leaves outside the codec), and the Web UI and
    the CLI give up on a whole history when one of its payloads fails to decode. The worker's own
    decoding stays strict: plain-text input is never accepted there."""
    if payload.metadata.get("encoding") != ENCODING:
        return payload
    (decoded,) = await codec.decode([payload])
    return decoded


class HideCodecKey(logging.Filter):
    """Masks a key in the codec path (`/codec/k/<key>/...`) in uvicorn's access log."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(KEY_IN_PATH.sub("/codec/k/***", a) if isinstance(a, str) else a for a in record.args)
        return True
