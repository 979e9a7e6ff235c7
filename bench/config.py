"""The settings the benchmarked processes run with, as `ragline.settings.Settings` objects.

Every limit the report mentions (a timeout, a slot count) is read from a `Settings` built from the very
environment the API or the worker was started with, and named by its environment variable, derived from
the field name: the report and the README then cannot disagree with the code.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ragline.settings import Settings


def env_name(field: str) -> str:
    """`temporal_rpc_timeout` -> `RAGLINE_TEMPORAL_RPC_TIMEOUT` (the variable pydantic-settings reads)."""
    if field not in Settings.model_fields:
        raise KeyError(f"ragline.settings.Settings has no field {field!r}")
    return f"{Settings.model_config.get('env_prefix', '')}{field}".upper()


class _FromMapping(Settings):
    """Settings from keyword arguments only: not from the environment of the bench process itself."""

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,  # noqa: ANN001
                                   file_secret_settings):  # noqa: ANN001, ANN206
        return (init_settings,)


def settings_from_env(env: Mapping[str, str]) -> Settings:
    """The Settings a child process builds from `env` (its RAGLINE_* variables; the rest are defaults).
    The children of the bench get no RAGLINE_* variable of the shell that started it (procs.child_env),
    so what is in `env` is all they see."""
    prefix = str(Settings.model_config.get("env_prefix", "")).upper()
    values: dict[str, Any] = {}
    for key, value in env.items():
        if key.upper().startswith(prefix):
            field = key[len(prefix):].lower()
            if field in Settings.model_fields:
                values[field] = value
    return _FromMapping(**values)


def value(settings: Settings, field: str) -> Any:
    return getattr(settings, field)


def is_set(env: Mapping[str, str], field: str) -> bool:
    return env_name(field) in env


def describe(settings: Settings, env: Mapping[str, str], fields: Iterable[str]) -> list[str]:
    """`RAGLINE_X = v` for each field that exists, with `(default)` when the environment leaves it unset."""
    out = []
    for field in fields:
        if field not in Settings.model_fields:
            continue
        v = value(settings, field)
        shown = "unset" if v is None else (f"{v:g}" if isinstance(v, float) else str(v))
        out.append(f"`{env_name(field)}` = {shown}" + ("" if is_set(env, field) else " (default)"))
    return out


def llm_slots(settings: Settings) -> int:
    """Model calls in flight per worker: the `llm` task queue's slots (`effective_llm_concurrency`)."""
    return settings.effective_llm_concurrency


def llm_slots_text(settings: Settings, env: Mapping[str, str]) -> str:
    """`RAGLINE_LLM_CONCURRENCY` = 64 (unset: the default for a remote endpoint), from the settings."""
    name = env_name("llm_concurrency")
    if settings.llm_concurrency is not None:
        return f"`{name}` = {settings.llm_concurrency}"
    kind = (f"a remote endpoint (`{env_name('llm_base_url')}` set)" if settings.llm_base_url
            else "the local llama.cpp server")
    return f"`{name}` unset: {llm_slots(settings)}, the default for {kind}"
