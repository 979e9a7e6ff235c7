"""The one way to build a Temporal client."""

from __future__ import annotations

from temporalio.client import Client
from temporalio.runtime import Runtime

from ragline import tracing
from ragline.settings import Settings
from temporal.converter import build_data_converter


async def connect(settings: Settings, *, lazy: bool = False, identity: str | None = None,
                  runtime: Runtime | None = None) -> Client:
    """`runtime`: the process's metrics Runtime (temporal.telemetry.metrics_runtime), else the SDK's default.
    The tracing interceptor sits on the client only: workers built from it inherit it."""
    kwargs = {"identity": identity} if identity else {}
    if runtime is not None:
        kwargs["runtime"] = runtime
    return await Client.connect(
        settings.temporal_address,
        namespace=settings.temporal_namespace,
        data_converter=build_data_converter(settings),
        interceptors=tracing.client_interceptors(),
        lazy=lazy,
        **kwargs,
    )
