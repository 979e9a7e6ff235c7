"""The FastAPI application: `uvicorn api.app:app`."""

from __future__ import annotations

import functools
import gc
import json
import logging
from contextlib import asynccontextmanager
from html import escape

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse

from api import errors, observability
from api.auth import Guard, authenticate
from api.cursors import CursorSigner, PasswordTags
from api.job_views import RecentlyAccepted
from api.limits import BodyLimit
from api.streams import JobStreams
from api.validators import known_query_parameters
from api.routes import agents, chats, documents, evaluations, events, health, jobs, search
from api.routes.codec import HideCodecKey, create_codec_app
from ragline import logs, tracing
from ragline.blobstore import BlobStore
from ragline.settings import Settings, get_settings
from temporal.client import connect


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    tracing.configure("ragline-api")
    guard = Guard(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        logs.configure(settings.log_level, settings.log_json, redact=settings.redact_pii)
        logging.getLogger("uvicorn.access").addFilter(HideCodecKey())
        app.state.settings = settings
        # A keys file that does not read stops the API here, with the reason, rather than fail every request.
        guard.keys.read()
        app.state.blobs = BlobStore(settings.blob_dir)
        # Lazy: the API starts (and /healthz says why) even while Temporal is still down.
        app.state.client = await connect(settings, lazy=True, identity="ragline-api")
        # The codec endpoint uses the very codec of the API's data converter.
        app.state.codec = app.state.client.data_converter.payload_codec
        # Listing cursors are signed with a key derived from the payload keys every API process shares.
        app.state.cursors = CursorSigner.for_deployment(settings.effective_codec_keys_file)
        app.state.password_tags = PasswordTags.for_deployment(settings.effective_codec_keys_file)
        # What was built at start lives as long as the process: keep it out of the collector's full
        # passes, which otherwise walk every imported module's objects during a burst of requests.
        gc.freeze()
        yield

    app = FastAPI(title="Ragline", version="0.1.0", lifespan=lifespan, telemetry=tracing.FASTAPI_NATIVE_TELEMETRY_OFF,
                  docs_url=None,  # ours, below: FastAPI's stays blank where its CDN is out of reach
                  description="Durable GenAI pipelines on Temporal: every request answers 202 with a job. "
                              "Every /v1 route needs an API key (`Authorization: Bearer <key>` or "
                              "`X-API-Key`) and sees only its tenant's documents and jobs.")
    app.state.guard = guard
    app.state.accepted = RecentlyAccepted()
    app.state.streams = JobStreams(settings.max_streams_per_key)
    app.state.temporal_health = health.SharedCheck(settings.healthz_cache_seconds)
    errors.install(app)
    for router in (documents.router, chats.router, agents.router, evaluations.router, jobs.router,
                   jobs.dead_letters, events.router, search.router):
        # The key first (401 before anything else), then the query's names (422 for one the route does not take).
        app.include_router(router, dependencies=[Depends(authenticate), Depends(known_query_parameters)])
    app.include_router(health.router)
    app.add_api_route("/docs", functools.partial(_docs_page, app), include_in_schema=False)
    _refine_schema(app, settings)
    app.mount("/codec", create_codec_app(settings, guard, lambda: getattr(app.state, "codec", None)))
    # An upload's bound is the key's tenant's (its max_upload_mb), known once BodyLimit has found the key.
    app.add_middleware(BodyLimit, guard=lambda: app.state.guard, limits={
        "/v1/documents": functools.partial(documents.body_cap, settings),
        "/v1/evaluations": evaluations.MAX_BODY_BYTES})
    # Outside the body limit: its refusals are counted, traced and carry X-Trace-Id like any answer.
    observability.install(app)
    return app


SWAGGER_JS = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"  # FastAPI's default
# Shown in place of Swagger UI when its script does not load (no internet: the script comes from a CDN).
SWAGGER_UNREACHABLE = ("Swagger UI could not be loaded from its CDN (this page needs the internet; Ragline "
                       "does not). The API is described in <a href=\"{url}\">{url}</a>, which any OpenAPI "
                       "viewer reads, and in the README.")


async def _docs_page(app: FastAPI, request: Request) -> HTMLResponse:
    """FastAPI's Swagger UI page, which tells the reader where to look when its script cannot load: before,
    a browser without the internet showed a blank page. Behind a proxy serving the API under a prefix
    (`root_path`), the schema is at <prefix>/openapi.json, as FastAPI's own page has it."""
    openapi_url = request.scope.get("root_path", "").rstrip("/") + app.openapi_url
    page = get_swagger_ui_html(openapi_url=openapi_url, title=f"{app.title} - Swagger UI",
                               swagger_js_url=SWAGGER_JS)
    html = page.body.decode()
    script = f'<script src="{SWAGGER_JS}"'
    # A JS string in an HTML attribute: quoted for each, whatever the prefix holds.
    message = f"<p>{SWAGGER_UNREACHABLE.format(url=escape(openapi_url))}</p>"
    fallback = f"document.getElementById('swagger-ui').innerHTML = {json.dumps(message)}"
    return HTMLResponse(html.replace(script, f'{script} onerror="{escape(fallback)}"', 1))


def _refine_schema(app: FastAPI, settings: Settings) -> None:
    """What pydantic cannot say: the agent ceilings are settings (RAGLINE_AGENT_MAX_*), so /openapi.json
    states this server's; an uploaded file must not be empty."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schemas = generate()["components"]["schemas"]
            schemas["AgentRequest"]["properties"]["max_depth"]["maximum"] = settings.agent_max_depth
            budget = schemas["BudgetRequest"]["properties"]
            budget["max_llm_calls"]["maximum"] = settings.agent_max_llm_calls
            budget["max_tokens"]["maximum"] = settings.agent_max_tokens
            budget["max_seconds"]["maximum"] = settings.agent_max_seconds
            schemas["Body_upload_documents_v1_documents_post"]["properties"]["files"]["items"]["minLength"] = 1
            # api/limits.py refuses an oversized body before any route sees it; api/errors.py a body
            # of another media type than the route reads.
            for path, operations in app.openapi_schema["paths"].items():
                post = operations.get("post", {}) if path.startswith("/v1/") else {}
                responses = post.get("responses")
                if responses is None:
                    continue
                _add_error_code(responses, "413", "body_too_large")
                media = set(post.get("requestBody", {}).get("content", {}))
                if media & {"application/json", "multipart/form-data"}:
                    _add_error_code(responses, "415", "unsupported_media_type")
        return app.openapi_schema

    app.openapi = openapi


def _add_error_code(responses: dict, status: str, code: str) -> None:
    """Documents `code` under `status`, beside the codes the route itself declared there."""
    if status not in responses:
        responses[status] = _error_response(code)
    elif code not in responses[status]["description"]:
        described = responses[status]["description"].replace("error code: ", "error codes: ")
        responses[status]["description"] = f"{described}, {code}"


def _error_response(code: str) -> dict:
    return {"description": f"error code: {code}",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}}


app = create_app()
