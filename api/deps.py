"""Dependencies shared by routes, as typed aliases: `client: ClientDep`, `settings: SettingsDep`...
They are `async def`: FastAPI runs a plain `def` dependency in its thread pool, one hop per dependency
per request, which under a burst queues behind every other request's hops."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from fastapi import Depends, Request
from temporalio.client import Client

from api.cursors import CursorSigner
from api.job_views import RecentlyAccepted
from api.streams import JobStreams
from ragline.blobstore import BlobStore
from ragline.settings import Settings


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_client(request: Request) -> Client:
    return request.app.state.client


async def get_blobs(request: Request) -> BlobStore:
    return request.app.state.blobs


async def get_accepted(request: Request) -> RecentlyAccepted:
    return request.app.state.accepted


SettingsDep = Annotated[Settings, Depends(get_settings)]
ClientDep = Annotated[Client, Depends(get_client)]
BlobsDep = Annotated[BlobStore, Depends(get_blobs)]
AcceptedDep = Annotated[RecentlyAccepted, Depends(get_accepted)]


async def get_streams(request: Request) -> JobStreams:
    return request.app.state.streams


StreamsDep = Annotated[JobStreams, Depends(get_streams)]


async def get_cursors(request: Request) -> CursorSigner:
    return request.app.state.cursors


CursorsDep = Annotated[CursorSigner, Depends(get_cursors)]


async def get_rpc_timeout(settings: SettingsDep) -> timedelta:
    """How long one call to the Temporal server may take (RAGLINE_TEMPORAL_RPC_TIMEOUT)."""
    return timedelta(seconds=settings.temporal_rpc_timeout)


RpcTimeoutDep = Annotated[timedelta, Depends(get_rpc_timeout)]
