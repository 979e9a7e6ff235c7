"""The one settings module. Every knob is an environment variable prefixed RAGLINE_."""

from __future__ import annotations

from datetime import timedelta
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from temporal.policies import parse_duration


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RAGLINE_", extra="ignore")

    data_dir: Path = Path("./data")
    api_host: str = "127.0.0.1"
    api_port: int = 8000

    temporal_address: str = "127.0.0.1:7233"
    temporal_ui_port: int = 8233
    temporal_namespace: str = "default"
    # How long Temporal keeps a finished job's history: GET /v1/jobs/{id}, the listings and an
    # Idempotency-Key's resend find the job for this long. `make run`'s dev server gets it at every
    # start (its own default is 24h); on a cluster it is the namespace's setting (deploy/helm).
    temporal_retention: str = "30d"
    # Beyond the dev server: TLS (server CA; client cert + key for mTLS) and/or an API key (Temporal
    # Cloud style; implies TLS). temporal_tls_server_name overrides the name checked in the certificate.
    temporal_tls: bool = False
    temporal_tls_ca: Path | None = None
    temporal_tls_cert: Path | None = None
    temporal_tls_key: Path | None = None
    temporal_tls_server_name: str | None = None
    temporal_api_key: str | None = None
    task_queue: str = "ragline"
    # Seconds an API call to Temporal may take before the API answers 504 (temporal_timeout).
    temporal_rpc_timeout: float = 10.0
    # Seconds a search may take (it runs in the worker) before the API answers 503.
    search_timeout: float = 30.0
    # Seconds the SSE relay waits after a batch of events before its next long-poll of the job's stream.
    # 0: the next poll is waiting in the workflow at once, so every event (the terminal one too) leaves
    # in the workflow task that publishes it; a pause batches events at the price of that much latency.
    events_poll_cooldown: float = Field(0.0, ge=0)
    # Event streams one API key may hold open at once, per API process (a stream of a running job holds a
    # long poll on Temporal for as long as it is open; a person follows a few, a dashboard a few dozen).
    max_streams_per_key: int = Field(100, ge=1)

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
    # Model calls in flight, per model endpoint: the `llm` task queue's slots. Unset: 1 for the local
    # llama.cpp server (it runs one request at a time: a second would wait inside it, its timeout running),
    # 64 for a remote endpoint.
    llm_concurrency: int | None = None
    # Optional cap on model calls started per second across all workers (the task queue's rate limit).
    llm_requests_per_second: float | None = None
    # Key in devtools.localmodel.MODELS: "qwen2.5-coder-0.5b" (default) or "qwen2.5-coder-1.5b".
    local_model: str = "qwen2.5-coder-0.5b"
    # Port of the local llama.cpp server; used only when llm_base_url is unset.
    llm_port: int = 8081
    # Threads of the local llama.cpp server. Unset: one per core but one, left to the worker and Temporal.
    # llama.cpp's threads wait for each other by spinning, so when another process takes a core every step
    # waits for the thread that lost it: on 2 cores, a test that took 10 s alone took 74 s on two threads
    # with one core busy, 35 s on one; alone, one thread streamed as fast as two.
    local_model_threads: int | None = Field(default=None, ge=1)
    # How an agent's model is held to its tools. "native": OpenAI `tools` (hosted APIs, vLLM with a tool
    # parser). "schema": a JSON reply constrained to the tools' schemas (llama.cpp's `response_format` with
    # a `schema`), so a small model can neither invent a tool nor write broken JSON. Unset: "schema" for
    # the local llama.cpp server `make run` starts, "native" for RAGLINE_LLM_BASE_URL.
    llm_tool_calls: Literal["native", "schema"] | None = None

    max_upload_mb: float = 50
    max_pages: int = 500
    # Documents with fewer non-whitespace characters than this fail as "no extractable text".
    min_text_chars: int = 16
    chunk_size: int = 800
    chunk_overlap: int = 120
    # Small batches keep a search waiting behind an embedding batch short (the model runs one at a time).
    embed_batch_size: int = 16
    embed_parallelism: int = 4

    # Activities in flight per worker: waits on other jobs and the gate (I/O, the main queue) / extraction
    # and embedding (CPU) / vector store activities and searches (the `vector` role). Model calls have
    # their own bound per endpoint (RAGLINE_LLM_CONCURRENCY).
    worker_io_concurrency: int = 64
    worker_cpu_concurrency: int = 4
    worker_vector_concurrency: int = 8
    # Workflow tasks in flight per worker (the `workflows` role; `all` too).
    worker_workflow_concurrency: int = 64
    # Processes `make run` starts, per role, e.g. "workflows:1,cpu:1,llm:2,vector:1". Unset: one
    # process of role `all` (every queue).
    workers: str | None = None
    # The cpu role sizes its slots by CPU and memory use (the SDK's resource-based tuner), between 1
    # and RAGLINE_WORKER_CPU_CONCURRENCY, instead of a fixed count.
    worker_resource_tuning: bool = False
    worker_target_cpu: float = 0.8
    worker_target_memory: float = 0.8
    # Pollers per queue scale with the backlog (the SDK's poller autoscaling), up to this many; 0: the
    # SDK's fixed default (5 per queue).
    worker_max_pollers: int = 0
    # Worker versioning: with a build id, workers join deployment `worker_deployment_name` as version
    # `worker_build_id`, and new workflows start on the deployment's current version.
    worker_deployment_name: str = "ragline"
    worker_build_id: str | None = None
    # Seconds a stopping worker lets activities in flight finish before cancelling them.
    worker_graceful_shutdown: float = 0.0

    # Agents: server-side ceilings on what a request may ask for (above them: 422).
    agent_max_depth: int = 6
    agent_max_llm_calls: int = 500
    agent_max_tokens: int = 2_000_000
    agent_max_seconds: float = 6 * 3600
    # How long anything waits for a human review before it is rejected ("review timed out"), e.g. "24h".
    review_timeout: str = "24h"

    @field_validator("temporal_retention")
    @classmethod
    def _a_retention(cls, value: str) -> str:
        """Temporal refuses a retention under a day; said at start, not when the dev server is up."""
        if parse_duration(value) < timedelta(days=1):
            raise ValueError(f"must be at least 1d (Temporal's minimum): {value!r}")
        return value

    @field_validator("step_sla")
    @classmethod
    def _slas(cls, value: dict[str, float]) -> dict[str, float]:
        """Twice an SLA must be a bound of the step latency histogram (ragline/metrics.py), which ends at 600 s:
        above it the alert could never fire."""
        from ragline.metrics import MAX_STEP_SLA_SECONDS

        # Under, not at: twice the cap is the highest bound, which histogram_quantile returns for a p95 above it.
        if wrong := {step: seconds for step, seconds in value.items() if not 0 < seconds < MAX_STEP_SLA_SECONDS}:
            raise ValueError(f"each step's SLA must be more than 0 and under {MAX_STEP_SLA_SECONDS:g} seconds: {wrong}")
        return value

    @field_validator("review_timeout")
    @classmethod
    def _a_duration(cls, value: str) -> str:
        """Checked at start: a bad value would otherwise fail every chat and agent request."""
        if parse_duration(value).total_seconds() <= 0:
            raise ValueError(f"must be more than 0: {value!r}")
        return value

    # The blob sweep (ragline/blob_sweep.py) deletes the blobs no job Temporal keeps refers to. The workflows
    # role keeps a Temporal Schedule that runs it this often ("0": no schedule; run `python -m
    # ragline.blob_sweep` by hand). A blob nobody refers to is kept until it was last put this long ago: it
    # must be longer than any activity takes from putting a blob to reporting it (minutes).
    blob_sweep_every: str = "1d"
    blob_sweep_min_age: str = "1d"

    @field_validator("blob_sweep_every", "blob_sweep_min_age")
    @classmethod
    def _a_sweep_duration(cls, value: str, info) -> str:
        if info.field_name == "blob_sweep_every" and value.strip() == "0":
            value = "0s"
        seconds = parse_duration(value).total_seconds()
        if info.field_name == "blob_sweep_min_age" and seconds < 3600:
            raise ValueError(f"must be at least 1h (blobs an activity is still reporting would go): {value!r}")
        if info.field_name == "blob_sweep_every" and 0 < seconds < 60:
            raise ValueError(f"must be 0 (no schedule) or at least 1m: {value!r}")
        return value

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

    # Observability. The worker serves the SDK's and Ragline's metrics (Prometheus format) on
    # worker_metrics_host:worker_metrics_port; 0 turns that off. The API serves its own at GET /metrics.
    worker_metrics_host: str = "127.0.0.1"
    worker_metrics_port: int = 9464
    # A file the worker touches every worker_alive_every seconds while its event loop runs and every one of its
    # task queues' workers runs: a liveness probe reads its age (deploy/k8s/workers.yaml). Unset: none.
    worker_alive_file: Path | None = None
    worker_alive_every: float = Field(default=10.0, gt=0)
    # Seconds between the worker's polls of the server's statistics (backlog, jobs waiting).
    metrics_poll_interval: float = 15.0
    # Ingestion counters carry the collection as a label (off: collections may be tenants, unbounded).
    metrics_collection_label: bool = False
    # Seconds each step should take, overriding ragline.metrics.DEFAULT_STEP_SLA_SECONDS (JSON object).
    step_sla: dict[str, float] = Field(default_factory=dict)
    # Seconds GET /healthz (no key needed) reuses its last look at Temporal (~7 RPCs) for every request,
    # so a flood of anonymous probes costs Temporal one check per period. Below the k8s readiness
    # probe's period (10 s, deploy/k8s/api.yaml): a probe still sees a change at its next look. 0: every
    # request checks (requests that arrive while a check runs still share it).
    healthz_cache_seconds: float = Field(5.0, ge=0, le=60)
    # Where job links point: the Temporal Web UI. Unset: http://127.0.0.1:<temporal_ui_port>.
    temporal_ui_url: str | None = None
    # `make run`: also start Prometheus on deploy/prometheus/ (RAGLINE_PROMETHEUS=1), listening here.
    prometheus: bool = False
    prometheus_port: int = 9090
    # -- security --------------------------------------------------------------------------------
    # API keys (TOML, [[keys]] with tenant, sha256, role, name, requests_per_minute) and per-tenant
    # limits ([tenants.<name>]). Unset: <data_dir>/api_keys.toml. `python -m ragline.keys create ...`.
    api_keys_file: Path | None = None
    # Requests per minute per API key unless its entry says otherwise (429 with Retry-After above it).
    rate_limit_per_minute: int = 600
    # Where the rate-limit counters live: memory:// (this API process only) or a Redis URL
    # (redis://host:6379/0, rediss://, redis+unix:///path.sock), which every API process shares.
    rate_limit_storage: str = Field("memory://", pattern=r"^(memory://$|redis://|rediss://|redis\+unix://)")
    # Seconds: a Redis that does not answer within the timeout counts as unreachable and the request goes
    # on unlimited; the next requests then skip the counters for the pause (an outage must not add the
    # timeout to every request), after which one tries them again.
    rate_limit_storage_timeout: float = Field(0.5, gt=0, le=30)
    rate_limit_storage_pause: float = Field(2.0, ge=0, le=300)
    # Jobs of one tenant running at once (ingest requests, chat turns, agent trees); more wait queued
    # (workflows/slot.py). `[tenants.<name>] max_running_jobs` in the keys file overrides it.
    tenant_max_running_jobs: int = Field(8, ge=1)
    # Turns one chat session holds not yet answered (the running one included): a message past them is
    # accepted (202), and its job fails at once with `SessionBusy`. Read by the API as it accepts a message,
    # which carries it. It keeps a session whose head turn waits days for a reviewer within Temporal's limits.
    session_max_queued_turns: int = Field(100, ge=1, le=500)  # (500 keep a session's carried state under 2 MB)
    # Documents one tenant may hold at once in the vector store, over all its collections: a new document
    # past it fails with the reason (ragline/vectorstore.py). Unset: no cap. `[tenants.<name>] max_documents`
    # in the keys file overrides it.
    tenant_max_documents: int | None = Field(None, ge=1)
    # Where the API appends its audit entries (ragline/audit.py), one JSON object per line: a file, or
    # "-" for standard output (a cluster's log pipeline). Unset: <data_dir>/audit.log. A file must
    # outlive the process: on a cluster, a shared volume and a file per pod (deploy/k8s/api.yaml).
    audit_log: str | None = Field(None, min_length=1)
    # AES-256-GCM payload encryption (temporal/codec.py). Keys file (TOML: current = "<id>", [keys]
    # <id> = "<base64 32 bytes>"); unset: <data_dir>/codec_keys.toml, created with one key if missing.
    encrypt_payloads: bool = True
    codec_keys_file: Path | None = None
    # Allowed Origin of the codec endpoint (the Temporal Web UI); unset: http://127.0.0.1:<ui port>
    # and http://localhost:<ui port>.
    codec_cors_origins: list[str] | None = None
    # Largest body the codec endpoint reads (MiB; 413 above it). The Web UI and the CLI send it the
    # payloads of one history event at a time, and Temporal refuses a payload over 2 MB: 16 MiB (with JSON's
    # base64, +1/3) holds any of them, while a few callers at once (every browser of the Web UI has a codec
    # key) cannot have the API hold more than its memory.
    codec_max_body_mb: float = Field(16, gt=0)
    # Mask phone numbers, e-mail addresses and ID numbers in text sent to a model that is not local,
    # and in logs.
    redact_pii: bool = False
    # Whether the chat model runs on this machine (no redaction; every reply read as a stream, so that a
    # cancel stops its generation); unset: local when RAGLINE_LLM_BASE_URL is unset or a loopback address.
    llm_local: bool | None = None

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
    def effective_temporal_ui_url(self) -> str:
        return (self.temporal_ui_url or f"http://127.0.0.1:{self.temporal_ui_port}").rstrip("/")

    @property
    def effective_api_keys_file(self) -> Path:
        return self.api_keys_file or self.data_dir / "api_keys.toml"

    @property
    def effective_codec_keys_file(self) -> Path:
        return self.codec_keys_file or self.data_dir / "codec_keys.toml"

    @property
    def audit_log_file(self) -> Path | None:
        """The audit file; None: standard output (RAGLINE_AUDIT_LOG=-)."""
        if self.audit_log == "-":
            return None
        return Path(self.audit_log) if self.audit_log else self.data_dir / "audit.log"

    @property
    def effective_codec_cors_origins(self) -> list[str]:
        if self.codec_cors_origins is not None:
            return self.codec_cors_origins
        return [f"http://127.0.0.1:{self.temporal_ui_port}", f"http://localhost:{self.temporal_ui_port}"]

    @property
    def llm_is_local(self) -> bool:
        """The chat model runs on this machine (llama.cpp started by `make run`, or a loopback URL)."""
        if self.llm_local is not None:
            return self.llm_local
        if not self.llm_base_url:
            return True
        from urllib.parse import urlparse
        return (urlparse(self.llm_base_url).hostname or "") in ("127.0.0.1", "localhost", "::1")

    @property
    def temporal_uses_tls(self) -> bool:
        # A key alone means TLS too: the client then refuses it for want of its certificate, where plain
        # gRPC would have ignored it without a word.
        return bool(self.temporal_tls or self.temporal_tls_ca or self.temporal_tls_cert or self.temporal_tls_key
                    or self.temporal_api_key)

    @property
    def worker_processes(self) -> list[tuple[str, int]]:
        """RAGLINE_WORKERS parsed and checked: [(role, processes), ...]."""
        from temporal.queues import check_topology, parse_workers

        workers = parse_workers(self.workers) if self.workers else [("all", 1)]
        check_topology(workers, embedded_store=not self.qdrant_url)
        return workers

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
    def codec_max_body_bytes(self) -> int:
        return int(self.codec_max_body_mb * 1024 * 1024)

    @property
    def effective_llm_concurrency(self) -> int:
        if self.llm_concurrency is not None:
            return self.llm_concurrency
        return 64 if self.llm_base_url else 1

    @property
    def effective_llm_tool_calls(self) -> str:
        return self.llm_tool_calls or ("native" if self.llm_base_url else "schema")

    @property
    def effective_llm_base_url(self) -> str:
        """The chat endpoint: RAGLINE_LLM_BASE_URL, else the local llama.cpp server `make run` starts."""
        return self.llm_base_url or f"http://127.0.0.1:{self.llm_port}/v1"


@lru_cache
def get_settings() -> Settings:
    return Settings()
