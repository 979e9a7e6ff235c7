"""The one settings module. Every knob is an environment variable prefixed RAGLINE_."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RAGLINE_", extra="ignore")

    data_dir: Path = Path("./data")
    api_host: str = "127.0.0.1"
    api_port: int = 8000

    temporal_address: str = "127.0.0.1:7233"
    temporal_ui_port: int = 8233
    temporal_namespace: str = "default"
    task_queue: str = "ragline"
    # Seconds an API call to Temporal may take before the API answers 503.
    temporal_rpc_timeout: float = 10.0
    # Seconds POST /v1/chats waits for its session to confirm the turn before answering 503. Under a
    # burst the confirmation can take seconds; a slow 202 beats a 503 for a turn that then runs anyway.
    accept_timeout: float = 30.0
    # Seconds a search may take (it runs in the worker) before the API answers 503.
    search_timeout: float = 30.0

    qdrant_url: str | None = None
    qdrant_api_key: str | None = None

    embeddings_base_url: str | None = None
    embeddings_model: str = "multilingual-e5-small"
    embeddings_api_key: str | None = None
    embeddings_dim: int = 384
    embeddings_timeout: float = 60.0

    # Chat model: any OpenAI-compatible endpoint. Unset: `make run` starts a local llama.cpp server
    # (model `local_model`, assembled by devtools.localmodel) on 127.0.0.1:llm_port.
    llm_base_url: str | None = None
    llm_api_key: str | None = None
    llm_model: str = "local"
    llm_timeout: float = 120.0
    llm_max_tokens: int = 512
    # Tokens the model's context holds (prompt + answer); passages beyond it are summarized first.
    llm_context_tokens: int = 4096
    # Model calls in flight, per model endpoint: the `llm` task queue's slots. Unset: 2 for the local
    # llama.cpp server (2 cores), 64 for a remote endpoint.
    llm_concurrency: int | None = None
    # Optional cap on model calls started per second across all workers (the task queue's rate limit).
    llm_requests_per_second: float | None = None
    # Key in devtools.localmodel.MODELS: "qwen2.5-coder-0.5b" (default) or "qwen2.5-coder-1.5b".
    local_model: str = "qwen2.5-coder-0.5b"
    # Port of the local llama.cpp server; used only when llm_base_url is unset.
    llm_port: int = 8081

    max_upload_mb: float = 50
    max_pages: int = 500
    # Documents with fewer non-whitespace characters than this fail as "no extractable text".
    min_text_chars: int = 16
    chunk_size: int = 800
    chunk_overlap: int = 120
    # Small batches keep a search waiting behind an embedding batch short (the model runs one at a time).
    embed_batch_size: int = 16
    embed_parallelism: int = 4

    # Activities in flight per worker: model calls and waits (I/O) / extraction and embedding (CPU).
    worker_io_concurrency: int = 64
    worker_cpu_concurrency: int = 4

    # Agents: server-side ceilings on what a request may ask for (above them: 422).
    agent_max_depth: int = 6
    agent_max_llm_calls: int = 500
    agent_max_tokens: int = 2_000_000
    agent_max_seconds: float = 6 * 3600
    # How long anything waits for a human review before it is rejected ("review timed out"), e.g. "24h".
    review_timeout: str = "24h"
    # Hold chat answers without a supporting citation for review.
    review_unsupported_answers: bool = False

    # Retrieval: a turn answers only from passages whose calibrated relevance (0..1) reaches this;
    # unset: the calibrated threshold in ragline/relevance.toml.
    relevance_threshold: float | None = None
    # Answers cached per (collection version, normalised question), in the process that owns the index.
    answer_cache_size: int = 1024

    # A lighter model a turn falls back to when the configured one keeps failing; unset: none.
    fallback_llm_base_url: str | None = None
    fallback_llm_model: str | None = None
    fallback_llm_api_key: str | None = None

    log_level: str = "INFO"
    log_json: bool = False

    policies: Path | None = Field(default=None, description="Alternative retry/timeout policy file")
    # Overrides [dead_letter].ttl of the policy file, e.g. "7d", "12h".
    dead_letter_ttl: str | None = None

    @property
    def temporal_host(self) -> str:
        return self.temporal_address.rsplit(":", 1)[0]

    @property
    def temporal_port(self) -> int:
        return int(self.temporal_address.rsplit(":", 1)[1])

    @property
    def blob_dir(self) -> Path:
        return self.data_dir / "blobs"

    @property
    def qdrant_path(self) -> Path:
        return self.data_dir / "qdrant"

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 1024 * 1024)

    @property
    def effective_llm_concurrency(self) -> int:
        if self.llm_concurrency is not None:
            return self.llm_concurrency
        return 64 if self.llm_base_url else 2

    @property
    def effective_llm_base_url(self) -> str:
        """The chat endpoint: RAGLINE_LLM_BASE_URL, else the local llama.cpp server `make run` starts."""
        return self.llm_base_url or f"http://127.0.0.1:{self.llm_port}/v1"


@lru_cache
def get_settings() -> Settings:
    return Settings()
