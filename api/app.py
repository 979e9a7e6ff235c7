"""The FastAPI application: `uvicorn api.app:app`."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from api import errors
from api.routes import agents, chats, documents, evaluations, events, health, jobs, search
from ragline import logs
from ragline.blobstore import BlobStore
from ragline.settings import Settings, get_settings
from temporal.client import connect


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        logs.configure(settings.log_level, settings.log_json)
        app.state.settings = settings
        app.state.blobs = BlobStore(settings.blob_dir)
        # Lazy: the API starts (and /healthz says why) even while Temporal is still down.
        app.state.client = await connect(settings, lazy=True, identity="ragline-api")
        yield

    app = FastAPI(title="Ragline", version="0.1.0", lifespan=lifespan,
                  description="Durable GenAI pipelines on Temporal: every request answers 202 with a job.")
    errors.install(app)
    for module in (documents, chats, agents, evaluations, jobs, events, search, health):
        app.include_router(module.router)
    return app


app = create_app()
