"""Dependencies shared by routes: settings, the Temporal client, the blob store."""

from __future__ import annotations

from datetime import timedelta

from fastapi import Request
from temporalio.client import Client

from ragline.blobstore import BlobStore
from ragline.settings import Settings


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_client(request: Request) -> Client:
    return request.app.state.client


def get_blobs(request: Request) -> BlobStore:
    return request.app.state.blobs


def rpc_timeout(settings: Settings) -> timedelta:
    return timedelta(seconds=settings.temporal_rpc_timeout)
