"""The one way to build a Temporal client: the dev server, a self-hosted cluster (TLS, mTLS) or
Temporal Cloud (API key), all from settings."""

from __future__ import annotations

from typing import Any

from temporalio.client import Client
from temporalio.runtime import Runtime
from temporalio.service import TLSConfig

from ragline import tracing
from ragline.settings import Settings
from temporal.converter import build_data_converter


def tls_config(settings: Settings) -> TLSConfig | bool:
    """False (plain gRPC, the dev server), True (TLS with the system's CAs) or a TLSConfig with the
    server CA, the client certificate and key (mTLS) and the server name to check."""
    if not settings.temporal_uses_tls:
        return False
    if (settings.temporal_tls_cert is None) != (settings.temporal_tls_key is None):
        raise ValueError("RAGLINE_TEMPORAL_TLS_CERT and RAGLINE_TEMPORAL_TLS_KEY go together (mTLS)")
    if not (settings.temporal_tls_ca or settings.temporal_tls_cert or settings.temporal_tls_server_name):
        return True
    return TLSConfig(
        server_root_ca_cert=settings.temporal_tls_ca.read_bytes() if settings.temporal_tls_ca else None,
        client_cert=settings.temporal_tls_cert.read_bytes() if settings.temporal_tls_cert else None,
        client_private_key=settings.temporal_tls_key.read_bytes() if settings.temporal_tls_key else None,
        domain=settings.temporal_tls_server_name,
    )


def connect_options(settings: Settings) -> dict[str, Any]:
    """Keyword arguments of `Client.connect` for these settings (built without any network)."""
    options: dict[str, Any] = {"namespace": settings.temporal_namespace, "tls": tls_config(settings)}
    if settings.temporal_api_key:
        options["api_key"] = settings.temporal_api_key
    return options


async def connect(settings: Settings, *, lazy: bool = False, identity: str | None = None,
                  runtime: Runtime | None = None) -> Client:
    """`runtime`: the process's metrics Runtime (temporal.telemetry.worker_runtime), else the SDK's default.
    The tracing interceptor sits on the client only: workers built from it inherit it."""
    kwargs: dict[str, Any] = {"identity": identity} if identity else {}
    if runtime is not None:
        kwargs["runtime"] = runtime
    return await Client.connect(
        settings.temporal_address,
        data_converter=build_data_converter(settings),
        interceptors=tracing.client_interceptors(),
        lazy=lazy,
        **connect_options(settings),
        **kwargs,
    )
