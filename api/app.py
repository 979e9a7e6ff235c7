"""The FastAPI application: `uvicorn api.app:app`."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from api import errors
from api.auth import Guard, authenticate
from api.routes import agents, chats, documents, events, health, jobs, search
from api.routes.codec import HideCodecKey, create_codec_app
from ragline import logs
from ragline.blobstore import BlobStore
from ragline.settings import Settings, get_settings
from temporal.client import connect


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    guard = Guard(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        logs.configure(settings.log_level, settings.log_json, redact=settings.redact_pii)
        logging.getLogger("uvicorn.access").addFilter(HideCodecKey())
        app.state.settings = settings
        app.state.blobs = BlobStore(settings.blob_dir)
        # Lazy: the API starts (and /healthz says why) even while Temporal is still down.
        app.state.client = await connect(settings, lazy=True, identity="ragline-api")
        # The codec endpoint uses the very codec of the API's data converter.
        app.state.codec = app.state.client.data_converter.payload_codec
        yield

    app = FastAPI(title="Ragline", version="0.1.0", lifespan=lifespan,
                  description="Durable GenAI pipelines on Temporal: every request answers 202 with a job. "
                              "Every route but /healthz needs an API key (`Authorization: Bearer <key>` or "
                              "`X-API-Key`) and sees only its tenant's documents and jobs.")
    app.state.guard = guard
    errors.install(app)
    for module in (documents, chats, agents, jobs, events, search):
        app.include_router(module.router, dependencies=[Depends(authenticate)])
    app.include_router(health.router)
    app.mount("/codec", create_codec_app(settings, guard, lambda: getattr(app.state, "codec", None)))
    return app


app = create_app()
