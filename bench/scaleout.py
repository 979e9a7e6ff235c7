"""`python -m bench scaleout` (part of `make bench`): model-bound throughput with 1 and then 2 workers
of role `llm`, in the same run, on the same stack, plus the ingestion throughput of one `cpu` worker
(what KEDA's targetQueueSize in deploy/k8s/keda.yaml is chosen from).

  Temporal        dev server (temporalio.testing.WorkflowEnvironment.start_local), in memory
  scripted model  devtools.scripted_llm in this process, every chat completion answers after --delay s
  API             api.app in this process (uvicorn)
  workers         python worker.py --role R: workflows, cpu, vector, and llm x1, then a second llm

Phase "1 llm worker": N chat turns, each in its own session (so they do not queue behind each other),
all submitted at once; wall time from the first submission to the last completion. Then a second llm
worker starts and the same N turns (new sessions) run again. Each turn makes 3 model calls (answer,
summary, entities), so the llm queue's slots (RAGLINE_LLM_CONCURRENCY per worker) bound the throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import uvicorn
from temporalio.testing import WorkflowEnvironment

from bench.procs import ROOT, child_env, free_port
from bench.report import write_section
from devtools.devserver import dynamic_config_flags, temporal_binary
from devtools.scripted_llm import ScriptedLLM
from ragline import keys
from ragline.settings import Settings
from temporal import search_attributes as sa

HEADING = "## Scale-out: 1 versus 2 llm workers"
TERMINAL = ("completed", "failed", "cancelled", "dead_lettered")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench scaleout", description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=24, help="chat turns per phase (default 24)")
    p.add_argument("--delay", type=float, default=1.0, help="seconds per model call (default 1)")
    p.add_argument("--llm-concurrency", type=int, default=2, help="slots per llm worker (default 2)")
    p.add_argument("--documents", type=int, default=10, help="documents ingested by the one cpu worker (default 10)")
    p.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    p.add_argument("--no-write", action="store_true")
    return p.parse_args(argv)


class Workers:
    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env, self.log_dir, self.procs = env, log_dir, []

    def start(self, role: str) -> None:
        log = (self.log_dir / f"worker-{role}-{len(self.procs)}.log").open("ab")
        self.procs.append(subprocess.Popen([sys.executable, "worker.py", "--role", role], cwd=ROOT, env=self.env,
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


async def _llm_pollers(http: httpx.AsyncClient, queue: str) -> int:
    health = (await http.get("/healthz")).json()["components"]["worker"]
    return (health.get("queues") or {}).get(f"{queue}-llm", {}).get("activity_pollers", 0)


async def _wait_until(probe, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await probe():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not reached within {timeout:.0f} s")
        await asyncio.sleep(0.5)


async def _wait_jobs(http: httpx.AsyncClient, job_ids: list[str], timeout: float = 600) -> list[dict]:
    async def one(job_id: str) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            job = (await http.get(f"/v1/jobs/{job_id}")).json()
            if job["status"] in TERMINAL or time.monotonic() > deadline:
                return job
            await asyncio.sleep(0.2)
    return list(await asyncio.gather(*(one(j) for j in job_ids)))


async def _chat_phase(http: httpx.AsyncClient, llm: ScriptedLLM, turns: int, tag: str) -> dict:
    calls_before = llm.count("answer", ok_only=True)
    started = time.monotonic()
    accepted = await asyncio.gather(*(http.post("/v1/chats", json={
        "message": f"Bench {tag} question {i}: who lights the lighthouses?", "collection": "scale",
        "session_id": f"{tag}-{i}-{uuid.uuid4().hex[:6]}"}) for i in range(turns)))
    jobs = await _wait_jobs(http, [r.json()["job_id"] for r in accepted])
    wall = time.monotonic() - started
    completed = sum(j["status"] == "completed" for j in jobs)
    mine = [c for c in llm.calls if c.endpoint == "chat" and c.ok and f"Bench {tag} " in c.question]
    return {"turns": turns, "completed": completed, "wall": wall, "turns_per_s": completed / wall,
            "model_calls": len(mine), "calls_per_s": len(mine) / wall,
            "answers": llm.count("answer", ok_only=True) - calls_before}


def _api_key(settings: Settings) -> str:
    """An operator key (/healthz shows it the pollers per queue) for the bench's tenant, with room for the
    bench's request rate and its jobs in flight (what is measured here is throughput per worker, not the
    per-tenant limits)."""
    path = settings.effective_api_keys_file
    key = keys.create(path, "bench", role="operator", name="bench-scaleout", requests_per_minute=1_000_000)
    with path.open("a") as f:
        f.write("\n[tenants.bench]\nmax_running_jobs = 100000\n")
    return key


async def run(args: argparse.Namespace) -> dict:
    data = Path(tempfile.mkdtemp(prefix="ragline-scaleout-"))
    env_server = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), search_attributes=list(sa.ALL),
        dev_server_extra_args=["--sqlite-pragma", "journal_mode=wal", "--sqlite-pragma", "synchronous=off",
                               *dynamic_config_flags()])
    address = env_server.client.service_client.config.target_host
    llm = ScriptedLLM()
    await llm.start()
    queue = "bench-scale"
    env = child_env({"RAGLINE_DATA_DIR": str(data), "RAGLINE_TEMPORAL_ADDRESS": address, "RAGLINE_TASK_QUEUE": queue,
                     "RAGLINE_LLM_BASE_URL": llm.base_url, "RAGLINE_LLM_MODEL": "scripted",
                     "RAGLINE_LLM_TIMEOUT": str(max(10.0, args.delay * 5)),
                     "RAGLINE_LLM_CONCURRENCY": str(args.llm_concurrency), "RAGLINE_WORKER_METRICS_PORT": "0",
                     "RAGLINE_RELEVANCE_THRESHOLD": "0", "RAGLINE_ANSWER_CACHE_SIZE": "0"})
    settings = Settings(**{k[len("RAGLINE_"):].lower(): v for k, v in env.items() if k.startswith("RAGLINE_")},
                        api_port=free_port())
    from api.app import create_app

    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=settings.api_port,
                                           log_level="warning", lifespan="on", timeout_keep_alive=600))
    server_task = asyncio.create_task(server.serve())
    workers = Workers(env, data)
    result: dict = {"delay": args.delay, "llm_concurrency": args.llm_concurrency, "cpu_count": os.cpu_count()}
    try:
        while not server.started:
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{settings.api_port}", timeout=120,
                                     limits=httpx.Limits(keepalive_expiry=2.0),
                                     headers={"Authorization": f"Bearer {_api_key(settings)}"}) as http:
            for role in ("vector", "workflows", "cpu", "llm"):
                workers.start(role)

            async def all_polled() -> bool:
                return (await http.get("/healthz")).json()["components"]["worker"]["status"] == "up"
            await _wait_until(all_polled, 120, "pollers on every queue")

            # One cpu worker: ingestion throughput (documents of ~6 chunks).
            text = " ".join(f"Sentence {k} of the harbour report says the keepers light the lamps at dusk."
                            for k in range(40))
            t0 = time.monotonic()
            up = await http.post("/v1/documents", data={"collection": "scale"}, files=[
                ("files", (f"d{n}.txt", f"Document {n}. {text}".encode())) for n in range(args.documents)])
            [job] = await _wait_jobs(http, [up.json()["job_id"]])
            ingest_wall = time.monotonic() - t0
            chunks = sum(d["chunks"] for d in job["result"]["documents"])
            result["ingest"] = {"documents": args.documents, "chunks": chunks, "wall": ingest_wall,
                                "chunks_per_s": chunks / ingest_wall, "status": job["status"]}

            llm.set_delay(0)
            await _chat_phase(http, llm, 2, "warmup")
            llm.set_delay(args.delay)
            result["one"] = await _chat_phase(http, llm, args.turns, "one")
            workers.start("llm")

            async def two_llm_pollers() -> bool:
                return await _llm_pollers(http, queue) >= 2
            await _wait_until(two_llm_pollers, 120, "a second llm worker polling")
            result["two"] = await _chat_phase(http, llm, args.turns, "two")
    finally:
        workers.stop()
        server.should_exit = True
        await server_task
        await llm.stop()
        await env_server.shutdown()
    result["ratio"] = result["two"]["turns_per_s"] / result["one"]["turns_per_s"]
    return result


def render(r: dict) -> str:
    one, two, ing = r["one"], r["two"], r["ingest"]
    return "\n".join([
        HEADING, "",
        f"`python -m bench scaleout` (in `make bench`): roles as separate processes (`worker.py --role`), "
        f"a scripted model answering every call after {r['delay']:g} s, RAGLINE_LLM_CONCURRENCY="
        f"{r['llm_concurrency']} per llm worker, {r['cpu_count']} cores shared by everything. Each phase: "
        f"{one['turns']} chat turns in separate sessions, submitted at once; 3 model calls per turn.", "",
        "| llm workers | turns completed | wall time | turns/s | model calls/s |",
        "| --- | --- | --- | --- | --- |",
        f"| 1 | {one['completed']}/{one['turns']} | {one['wall']:.1f} s | {one['turns_per_s']:.2f} | {one['calls_per_s']:.2f} |",
        f"| 2 | {two['completed']}/{two['turns']} | {two['wall']:.1f} s | {two['turns_per_s']:.2f} | {two['calls_per_s']:.2f} |",
        "",
        f"**2 workers / 1 worker: {r['ratio']:.2f}x** model-bound throughput (goal: at least 1.7x).", "",
        f"One cpu worker (2 cores shared with the other roles, the server and the API) ingested "
        f"{ing['documents']} text documents, {ing['chunks']} chunks, in {ing['wall']:.1f} s: "
        f"{ing['chunks_per_s']:.1f} chunks/s ({ing['chunks_per_s'] / 16:.2f} embedding batches of 16 per second). "
        "KEDA's targetQueueSize per role (deploy/k8s/keda.yaml) is this per-worker throughput times the "
        "backlog wait we accept.", ""])


def main(argv: list[str] | None = None) -> int:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse_args(argv)
    result = asyncio.run(run(args))
    section = render(result)
    print(section)
    if not args.no_write:
        write_section(args.output, section, HEADING)
    ok = result["one"]["completed"] == result["two"]["completed"] == args.turns
    return 0 if ok else 1
