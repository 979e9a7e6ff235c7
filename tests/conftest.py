"""One real stack per test session: a Temporal dev server on free ports, the worker (in-process,
real embedded Qdrant and real embedding model) and the API served by uvicorn on a free port.

Telemetry is on as in production, once per process: every span goes to an in-memory exporter
(`SPANS`, the `spans` fixture), and one metrics Runtime (`metrics_runtime()`) serves the in-process
workers' metrics on a free port; the dev server serves its own on `TEMPORAL_METRICS_PORT`.

Security is on as in production: payloads are encrypted (a codec keys file in the data folder) and
the API wants keys. The stack's keys file holds, for tenant `acme`, a reviewer key (`Stack.http`
sends it) and a member key (`Stack.member_http`), and for tenant `globex` a reviewer key
(`Stack.other_http`): the same tests can prove that tenants do not see each other."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import random
import shutil
import socket
import subprocess
import tempfile
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import uvicorn
from fastapi import FastAPI
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ragline import tracing

# Before the app and the clients exist: the process's tracer provider records every span here.
SPANS = InMemorySpanExporter()
tracing.configure("ragline-test", exporter=SPANS)
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from api.app import create_app
from ragline import keys as api_keys
from ragline.settings import Settings
from ragline.vectorstore import VectorIndex, open_index
from temporal import search_attributes as sa
from temporal.client import connect
from temporal.telemetry import ServerStatsPoller, export_activity_slots, export_step_sla, worker_runtime
from devtools.devserver import dynamic_config_flags, temporal_binary
from devtools.scripted_llm import ScriptedLLM
from worker import build_worker

SHARED_PDFS = Path(__file__).resolve().parent.parent.parent / "shared" / "pdfs"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_server_port(span: int = 12) -> int:
    """A port p with p..p+span-1 free, below the kernel's ephemeral range, for a server that must come
    back on the same ports after a restart: an ephemeral port could be taken meanwhile by an outgoing
    connection. (The dev server puts its HTTP API on p+10 and metrics on p+11.)"""
    rng = random.Random()
    low, high = _server_port_range()
    for _ in range(500):
        base = rng.randrange(low, high - span)
        if all(_bindable(base + i) for i in (0, 10, 11) if i < span) and _bindable(base + span - 1):
            return base
    raise RuntimeError("no free port block found below the ephemeral range")


def _server_port_range() -> tuple[int, int]:
    """Each pytest-xdist process (PYTEST_XDIST_WORKER gw0, gw1, ...) picks in a slice of its own, so two
    processes never choose the same block between checking it and binding it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    size = (32000 - 20000) // max(count, 1)
    low = 20000 + int(worker.removeprefix("gw")) * size
    return low, low + size


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


_RUNTIME: dict = {}


def metrics_runtime():
    """The process's one metrics Runtime (its Prometheus port binds once), made on first use; every
    in-process worker's client uses it, so its scrape holds every test stack (labelled by task_queue)."""
    if "runtime" not in _RUNTIME:
        port = free_port()
        _RUNTIME.update(runtime=worker_runtime(f"127.0.0.1:{port}"), url=f"http://127.0.0.1:{port}/metrics",
                        port=port)
    return _RUNTIME["runtime"]


def worker_metrics_url() -> str:
    metrics_runtime()
    return _RUNTIME["url"]


TEMPORAL_METRICS_PORT = free_server_port()
# The SDK gives a server it starts 5 s to answer: too little for two test processes starting theirs at
# once on 2 busy cores.
SERVER_STARTUP = timedelta(seconds=60)
# Every stack of the test session is one deployment's worth of processes on one namespace, and tenant
# `acme` lists the jobs of all of them: like the API and the workers of a deployment, they share one
# set of payload keys (a test that needs keys of its own sets codec_keys_file).
SHARED_CODEC_KEYS = Path(tempfile.mkdtemp(prefix="ragline-test-codec-")) / "codec_keys.toml"


def shared_pdf(name: str) -> Path:
    path = SHARED_PDFS / name
    if not path.exists():
        pytest.fail(f"{path} is not here: the shared PDFs are part of the test setup (../shared/pdfs sits "
                    "beside the project folder)", pytrace=False)
    return path


@dataclass
class Stack:
    settings: Settings
    client: Client
    http: httpx.AsyncClient
    index: VectorIndex | None
    base_url: str
    llm: ScriptedLLM
    # tenant `acme`: "reviewer" (http), "member" (member_http); tenant `globex`: "other" (other_http)
    keys: dict[str, str]
    member_http: httpx.AsyncClient
    other_http: httpx.AsyncClient
    app: FastAPI
    tenant: str = "acme"
    other_tenant: str = "globex"

    def workflow_id(self, local_id: str) -> str:
        """The Temporal workflow id of one of `tenant`'s jobs (for tests that talk to Temporal directly)."""
        return f"{self.tenant}.{local_id}"

    async def wait_job(self, job_id: str, timeout: float = 120,
                       until: tuple[str, ...] = ("completed", "failed", "cancelled", "dead_lettered",
                                                 "waiting_review")) -> dict:
        """Poll the API until the job reaches one of `until` (by default: ended, or waiting for a person).
        A 503 or 504 (Temporal not reachable, or slow: "try again shortly") is polled through, as a client
        does; until the deadline."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            r = await self.http.get(f"/v1/jobs/{job_id}")
            job = None
            if r.status_code not in (503, 504):
                assert r.status_code == 200, r.text
                job = r.json()
                if job["status"] in until:
                    return job
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"job {job_id} still {job['status'] if job else r.text} after {timeout} s")
            await asyncio.sleep(0.2)

    async def wait_done(self, job_id: str, timeout: float = 120) -> dict:
        """Until the job has ended (after a decision, the job may still show the status it had)."""
        return await self.wait_job(job_id, timeout, until=("completed", "failed", "cancelled"))

    async def upload(self, *files: tuple[str, bytes], collection: str = "default", password: str | None = None,
                     expect: int = 202) -> dict:
        data = {"collection": collection}
        if password is not None:
            data["password"] = password
        r = await self.http.post("/v1/documents", files=[("files", (n, b)) for n, b in files], data=data)
        assert r.status_code == expect, r.text
        return r.json()

    async def chat(self, message: str, *, session_id: str | None = None, collection: str = "default",
                   idempotency_key: str | None = None, top_k: int = 5) -> dict:
        body = {"message": message, "collection": collection, "top_k": top_k}
        if session_id:
            body["session_id"] = session_id
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        r = await self.http.post("/v1/chats", json=body, headers=headers)
        assert r.status_code == 202, r.text
        return r.json()

    async def search(self, query: str, collection: str = "default", top_k: int = 5) -> list[dict]:
        r = await self.http.post("/v1/search", json={"query": query, "collection": collection, "top_k": top_k})
        assert r.status_code == 200, r.text
        return r.json()["hits"]


@pytest_asyncio.fixture(scope="session")
async def temporal_env():
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), dev_server_startup_timeout=SERVER_STARTUP,
        search_attributes=list(sa.ALL),
        dev_server_extra_args=["--sqlite-pragma", "journal_mode=wal", "--sqlite-pragma", "synchronous=off",
                               "--metrics-port", str(TEMPORAL_METRICS_PORT), *dynamic_config_flags()],
    )
    yield env
    await env.shutdown()


@pytest_asyncio.fixture(scope="session")
async def scripted_llm():
    llm = ScriptedLLM()
    await llm.start()
    yield llm
    await llm.stop()


@pytest.fixture
def spans() -> InMemorySpanExporter:
    """Every span recorded in this process so far (filter by the trace id of your own request)."""
    return SPANS


@pytest.fixture
def restore_policies():
    """For a test that loads other policies (`temporal.policies.load` is process-wide, and the session's
    in-process worker runs on what was loaded): puts the loaded policies back afterwards."""
    from temporal import policies

    saved = policies._loaded
    yield
    policies._loaded = saved


@pytest_asyncio.fixture
async def private_llm():
    """A scripted model of the test's own, for a test that turns server-wide knobs (random faults, a delay
    on every request, reset()): the session's shared `scripted_llm` is left as it was. Tests on the
    shared one use `scripted_llm.scope()` instead, so their scripts reach only their own requests."""
    llm = ScriptedLLM()
    await llm.start()
    yield llm
    await llm.stop()


@asynccontextmanager
async def serving_api(app: FastAPI, port: int | None = None):
    """Serve an API app (its lifespan included) with uvicorn on 127.0.0.1; yields its base URL."""
    port = port or free_port()
    # The server's idle keep-alive must outlast the clients' (2 s in the stack's): otherwise a request
    # sent on a connection the server is closing at that moment fails with ReadError. Here it races
    # easily, as server and client share one event loop, where a busy step delays the close.
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on", timeout_keep_alive=600))
    server_task = asyncio.create_task(server.serve())
    while not server.started:
        if server_task.done():
            server_task.result()  # it could not start: say why
        await asyncio.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await server_task


class RedisServer:
    """Debian's redis-server on a port of its own, no persistence; stop() and start() again on the same
    port stand for an outage of the Redis the API processes share."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = free_server_port(span=1)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    async def start(self) -> None:
        import redis

        self.process = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                         "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        probe = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        try:
            for _ in range(200):
                try:
                    if probe.ping():
                        return
                except redis.ConnectionError:
                    if self.process.poll() is not None:
                        raise RuntimeError(f"redis-server exited with {self.process.returncode}") from None
                    await asyncio.sleep(0.05)
            raise RuntimeError(f"redis-server on port {self.port} did not answer within 10 s")
        finally:
            probe.close()

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


@pytest_asyncio.fixture
async def redis_server():
    """A running Redis of the test's own (`make test` installs Debian's redis-server)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: `make test` installs it (apt-get install redis-server)",
                    pytrace=False)
    server = RedisServer(binary)
    await server.start()
    try:
        yield server
    finally:
        server.stop()


@asynccontextmanager
async def running_stack(address: str, llm: ScriptedLLM, data_dir: Path, *, in_process_worker: bool = True,
                        **overrides):
    """A worker (in-process unless told otherwise) and the API on a free port, against `address`."""
    api_port = free_port()
    options = dict(data_dir=data_dir, temporal_address=address, api_port=api_port, task_queue="ragline-test",
                   embed_batch_size=16, llm_base_url=llm.base_url, llm_model="scripted", llm_timeout=3,
                   policies=FIXTURES.parent / "fast_policies.toml", metrics_poll_interval=1.0,
                   rate_limit_per_minute=100_000, codec_keys_file=SHARED_CODEC_KEYS,
                   # The shared stack's questions test plumbing with made-up texts: no relevance gate and
                   # no answer cache there. tests/test_grounded.py runs a stack with both, as shipped.
                   relevance_threshold=0.0, answer_cache_size=0,
                   # Tests share tenant acme: its cap on running jobs stays out of their way.
                   # tests/test_running_slots.py caps tenants of its own through the keys file.
                   tenant_max_running_jobs=10_000)
    options.update(overrides)
    settings = Settings(**options)
    api_port = settings.api_port
    keys_file = settings.effective_api_keys_file
    keys = {"reviewer": api_keys.create(keys_file, "acme", "reviewer", "acme-reviewer"),
            "operator": api_keys.create(keys_file, "acme", "operator", "acme-operator"),
            "member": api_keys.create(keys_file, "acme", "member", "acme-member"),
            "other": api_keys.create(keys_file, "globex", "reviewer", "globex-reviewer")}
    client = await connect(settings, runtime=metrics_runtime())
    index = open_index(settings) if in_process_worker else None
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=8)
    worker = build_worker(client, settings, index, executor) if in_process_worker else None
    worker_task = asyncio.create_task(worker.run()) if worker else None
    poller = asyncio.create_task(ServerStatsPoller(client, settings, metrics_runtime()).run()) if worker else None
    if worker:
        export_step_sla(metrics_runtime(), settings)  # as worker.main does, for the rules' SLA series
        export_activity_slots(metrics_runtime(), worker.activity_slots)  # ... and their queue capacities
    app = create_app(settings)
    try:
        async with serving_api(app, api_port) as base_url:
            def http_for(role: str) -> httpx.AsyncClient:
                return httpx.AsyncClient(base_url=base_url, timeout=60, limits=httpx.Limits(keepalive_expiry=2.0),
                                         headers={"Authorization": f"Bearer {keys[role]}"})

            async with http_for("reviewer") as http, http_for("member") as member_http, \
                    http_for("other") as other_http:
                yield Stack(settings=settings, client=client, http=http, index=index, base_url=base_url, llm=llm,
                            keys=keys, member_http=member_http, other_http=other_http, app=app)
    finally:
        if poller:
            poller.cancel()
        if worker:
            await worker.shutdown()
            await worker_task
        executor.shutdown(wait=False, cancel_futures=True)
        if index:
            index.close()


@pytest_asyncio.fixture(scope="session")
async def stack(temporal_env, scripted_llm, tmp_path_factory):
    address = temporal_env.client.service_client.config.target_host
    async with running_stack(address, scripted_llm, tmp_path_factory.mktemp("ragline-data")) as s:
        yield s
