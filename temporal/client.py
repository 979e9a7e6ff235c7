"""The one way to build a Temporal client."""

from __future__ import annotations

from temporalio.client import Client

from ragline.settings import Settings
from temporal.converter import build_data_converter


async def connect(settings: Settings, *, lazy: bool = False, identity: str | None = None) -> Client:
    kwargs = {"identity": identity} if identity else {}
    return await Client.connect(
        settings.temporal_address,
        namespace=settings.temporal_namespace,
        data_converter=build_data_converter(settings),
        lazy=lazy,
        **kwargs,
    )
