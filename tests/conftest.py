"""One real stack per test session: a Temporal dev server on free ports, the worker (in-process,
real embedded Qdrant and real embedding model) and the API served by uvicorn on a free port."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import socket
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import uvicorn
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from api.app import create_app
from ragline.settings import Settings
from ragline.vectorstore import VectorIndex, open_index
from temporal import search_attributes as sa
from temporal.client import connect
from devtools.devserver import temporal_binary
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
    for _ in range(500):
        base = rng.randrange(20000, 32000 - span)
        if all(_bindable(base + i) for i in (0, 10, 11) if i < span) and _bindable(base + span - 1):
            return base
    raise RuntimeError("no free port block found below the ephemeral range")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def shared_pdf(name: str) -> Path:
    path = SHARED_PDFS / name
    if not path.exists():
        pytest.skip(f"{path} is not here (../shared/pdfs sits beside the project folder)")
    return path


@dataclass
class Stack:
    settings: Settings
    client: Client
    http: httpx.AsyncClient
    index: VectorIndex | None
    base_url: str
    llm: ScriptedLLM

    async def wait_job(self, job_id: str, timeout: float = 120,
                       until: tuple[str, ...] = ("completed", "failed", "cancelled", "dead_lettered",
                                                 "waiting_review")) -> dict:
        """Poll the API until the job reaches one of `until` (by default: ended, or waiting for a person)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            r = await self.http.get(f"/v1/jobs/{job_id}")
            assert r.status_code == 200, r.text
            job = r.json()
            if job["status"] in until:
                return job
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"job {job_id} still {job['status']} after {timeout} s: {job}")
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
        dev_server_existing_path=temporal_binary(),
        search_attributes=list(sa.ALL),
        dev_server_extra_args=["--sqlite-pragma", "journal_mode=wal", "--sqlite-pragma", "synchronous=off"],
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
def restore_policies():
    """For a test that loads other policies (`temporal.policies.load` is process-wide, and the session's
    in-process worker runs on what was loaded): puts the loaded policies back afterwards."""
    from temporal import policies

    saved = policies._loaded, policies._dead_letter_ttl
    yield
    policies._loaded, policies._dead_letter_ttl = saved


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
async def running_stack(address: str, llm: ScriptedLLM, data_dir: Path, *, in_process_worker: bool = True,
                        **overrides):
    """A worker (in-process unless told otherwise) and the API on a free port, against `address`."""
    api_port = free_port()
    options = dict(data_dir=data_dir, temporal_address=address, api_port=api_port, task_queue="ragline-test",
                   embed_batch_size=16, llm_base_url=llm.base_url, llm_model="scripted", llm_timeout=3,
                   policies=FIXTURES.parent / "fast_policies.toml",
                   # The shared stack's questions test plumbing with made-up texts: no relevance gate and
                   # no answer cache there. tests/test_grounded.py runs a stack with both, as shipped.
                   relevance_threshold=0.0, answer_cache_size=0)
    options.update(overrides)
    settings = Settings(**options)
    client = await connect(settings)
    index = open_index(settings) if in_process_worker else None
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=8)
    worker = build_worker(client, settings, index, executor) if in_process_worker else None
    worker_task = asyncio.create_task(worker.run()) if worker else None
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=api_port,
                                           log_level="warning", lifespan="on"))
    server_task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    base_url = f"http://127.0.0.1:{api_port}"
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            yield Stack(settings=settings, client=client, http=http, index=index, base_url=base_url, llm=llm)
    finally:
        server.should_exit = True
        await server_task
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
