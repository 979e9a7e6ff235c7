"""`make bench`: chat acceptance latency of Ragline next to a plain synchronous FastAPI app and the
bare Temporal `start_workflow` floor, with a scripted model that answers every chat completion after
`--delay` seconds, then Ragline against its floors (bench/ratios.py). Everything runs on loopback in
one run, on free ports and a temporary data folder:

  scripted model   python -m devtools.scripted_llm --port L --delay D        (shared by both apps)
  Temporal         devtools.devserver.DevServer (SQLite in the temp folder, WAL)
  Ragline worker   python worker.py                                       (RAGLINE_* env)
  Ragline API      python -m uvicorn api.app:app --workers 1               (the same RAGLINE_* env)
  sync baseline    python -m uvicorn bench.sync_app:app --workers 1
  floor worker     python -m bench.floor_worker (a bare workflow with one activity, own task queue)
  local model      llama.cpp (devtools.localmodel), only for the `local` phase, if installed

Phases, in this order: setup + ingest one small document into collection "bench" (so every chat turn
retrieves a passage and really calls the model: answer, summarize, extract_entities), warm-up with the
model delay at 0, then with the delay at D: (1) N concurrent bare start_workflow calls, (2) N concurrent
POST /v1/chats to the sync app, (3) N concurrent POST /v1/chats to Ragline, then wait until Ragline's N
jobs are done (GET /v1/jobs every --poll-interval s) and check every one (GET /v1/jobs/{id}).
Then (bench/ratios.py) the turns one at a time, before the bursts fill the server's store: `ttfd` (first
answer delta against a bare streamed call, scripted model) and `overhead` (a turn at a 0 s model against
a bare one-activity workflow); then `burst` (rounds of N chats at once, each followed on its SSE stream,
each round after a burst of the sync app), `local` (first answer delta with the local model: its model
time dwarfs the rest) and `order` (--seq-requests over --seq-sessions sessions, each session's in order,
for Ragline, the floor and the sync app). Last, on the same stack with the worker restarted with
RAGLINE_LLM_TIMEOUT=3, completion under injected model faults (bench/faults.py). --phases picks a subset (for development).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from bench import config, floor_worker, procs, ratios, rawhttp, report
from bench.measure import Burst, Drain, burst, percentile
from bench.procs import KEEP_ALIVE, LOOPBACK, ROOT, Proc, child_env, free_port, http_ok, temporal_ports
from bench.sse import chat_turn
from models.chat import session_of_turn, session_workflow_id

TERMINAL = ("completed", "failed", "cancelled", "dead_lettered")
COLLECTION = "bench"
NOOP_WORKFLOW = "BenchNoop"
NOOP_QUEUE = "bench-noop-unpolled"
FLOOR_QUEUE = "bench-one-step"
TENANT = "bench"
# The bench's key may send this many requests per minute (its `requests_per_minute` in the keys file):
# a run sends thousands within a minute, far above what one client of a deployment would.
API_KEY_RPM = 1_000_000
# The bench's tenant may run this many jobs at once (`[tenants.bench] max_running_jobs`): the bench
# measures orchestration with hundreds of turns in flight, not the per-tenant cap (tests cover that).
TENANT_MAX_RUNNING_JOBS = 100_000
# The bench's key may hold this many event streams open on the API (RAGLINE_MAX_STREAMS_PER_KEY): the burst
# follows each of its chats on a stream of its own, more than the default 100 a client would hold.
STREAMS_PER_KEY = 10_000
PHASES = ("accept", "burst", "ttfd", "overhead", "local", "order", "faults")
QUESTION = "Which company runs the Lisbon data centre, and what does it use for cooling?"
FOLLOW_UP_QUESTION = "Who leads its operations team?"
DOCUMENT = """\
Northwind Analytics opened its Lisbon data centre in March 2024. The building is cooled with sea water
drawn from the Tagus estuary, which cut the energy spent on cooling by about forty percent compared with
the older Frankfurt site. Maria Santos leads the operations team; the facility hosts the retrieval and
chat services of the Ragline platform, and every request is logged for ninety days.
"""


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=200, help="concurrent requests per target (default 200)")
    p.add_argument("--delay", type=float, default=5.0, help="seconds the model takes per chat completion (default 5)")
    p.add_argument("--e2e-timeout", type=float, default=600.0,
                   help="max seconds to wait for all Ragline chat jobs to finish (0: do not wait; default 600)")
    p.add_argument("--poll-interval", type=float, default=1.0, help="seconds between job polls (default 1)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="per-request client timeout (default 300)")
    p.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md", help="Markdown file to update")
    p.add_argument("--no-write", action="store_true", help="print the results, do not touch BENCHMARKS.md")
    p.add_argument("--keep-data", action="store_true", help="keep the temp data folder and logs")
    p.add_argument("--from-results", type=Path, metavar="JSON",
                   help="run nothing: render the sections again from a raw results file of an earlier run "
                        "(bench/results/chat-*.json) and write them (with --output, unless --no-write)")
    r = p.add_argument_group("Ragline against its floors (bench/ratios.py)")
    r.add_argument("--phases", default=",".join(PHASES),
                   help=f"comma-separated subset of {','.join(PHASES)} (default: all; the report notes what "
                        f"was left out)")
    r.add_argument("--light-rounds", type=int, default=3,
                   help="rounds of the light client's burst, each right after a floor burst of its own, pooled "
                        "(default 3)")
    r.add_argument("--burst-chats", type=int, default=200,
                   help="chats at once in `burst`, each followed on its SSE stream, at --delay (default 200)")
    r.add_argument("--burst-rounds", type=int, default=3,
                   help="rounds of `burst`, each a sync-app burst of as many requests right before a Ragline "
                        "burst; the verdict is the median round's ratio (default 3)")
    r.add_argument("--seq-requests", type=int, default=1000, help="POST /v1/chats in `order` (default 1000)")
    r.add_argument("--seq-sessions", type=int, default=50,
                   help="sessions in `order`, each sending its share one after another (default 50)")
    r.add_argument("--ttfd-turns", type=int, default=10, help="sequential turns in `ttfd` (default 10)")
    r.add_argument("--ttfd-delay", type=float, default=0.5,
                   help="scripted model: seconds before a reply starts in `ttfd` (default 0.5)")
    r.add_argument("--ttfd-chunk-delay", type=float, default=0.02,
                   help="scripted model: seconds between streamed pieces in `ttfd` (default 0.02)")
    r.add_argument("--overhead-turns", type=int, default=30,
                   help="sequential turns (and bare workflows) in `overhead`, after 3 of each to warm up (default 30)")
    r.add_argument("--local-turns", type=int, default=5, help="sequential turns with the local model (default 5)")
    r.add_argument("--local-model-threads", type=int, default=None,
                   help="threads of the local llama.cpp server (default: RAGLINE_LOCAL_MODEL_THREADS's default)")
    r.add_argument("--local-model", default=None,
                   help="local model key (default: the RAGLINE_LOCAL_MODEL default of ragline.settings)")
    f = p.add_argument_group("completion under injected faults (after the acceptance benchmark)")
    f.add_argument("--fault-chats", type=int, default=40, help="chat turns per fault rate, over 10 sessions (default 40)")
    f.add_argument("--fault-ingests", type=int, default=5, help="small text documents ingested per fault rate (default 5)")
    f.add_argument("--fault-rate", type=float, default=0.12,
                   help="share of model calls that fail in the second run (default 0.12; the first runs at 0)")
    f.add_argument("--fault-delay", type=float, default=0.5, help="model delay during the fault runs (default 0.5 s)")
    f.add_argument("--fault-deadline", type=float, default=600.0, help="max seconds per fault rate (default 600)")
    f.add_argument("--skip-faults", action="store_true", help="leave out the fault phase (same as leaving "
                                                               "`faults` out of --phases)")
    args = p.parse_args(argv)
    args.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    unknown = [x for x in args.phases if x not in PHASES]
    if unknown:
        p.error(f"unknown phase(s) {', '.join(unknown)}; known: {', '.join(PHASES)}")
    if args.skip_faults and "faults" in args.phases:
        args.phases.remove("faults")
    if not 0 < args.fault_rate <= 1 or args.fault_chats < 0 or args.fault_ingests < 0 or args.fault_delay < 0:
        p.error("--fault-rate must be within (0, 1], --fault-chats, --fault-ingests and --fault-delay >= 0")
    if not 1 <= args.burst_rounds <= 10:
        p.error("--burst-rounds must be within 1..10")
    if not 1 <= args.requests <= 1000 or not 1 <= args.burst_chats <= 1000:
        p.error("--requests and --burst-chats must be within 1..1000 (the load stays bounded)")
    if not 1 <= args.seq_sessions <= args.seq_requests <= 5000 or args.seq_requests % args.seq_sessions:
        p.error("--seq-requests must be a multiple of --seq-sessions, at most 5000")
    if min(args.ttfd_turns, args.overhead_turns, args.local_turns) < 1:
        p.error("--ttfd-turns, --overhead-turns and --local-turns must be >= 1")
    if args.delay < 0 or args.poll_interval <= 0 or args.ttfd_delay < 0 or args.ttfd_chunk_delay < 0:
        p.error("--delay, --ttfd-delay and --ttfd-chunk-delay must be >= 0 and --poll-interval > 0")
    return args


def http_client(base_url: str, n: int, timeout: float) -> httpx.AsyncClient:
    """Room for n connections at once, loopback only (no proxy from the environment), with the API key."""
    return procs.client(base_url, httpx.Timeout(timeout, connect=60.0), n)


# --------------------------------------------------------------------------------------------------
# the stack


class Stack:
    """Everything the bench starts; stop() undoes it in reverse order, whatever happened."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.log_dir = data_dir / "logs"
        self.procs: list[Proc] = []
        self.temporal = None  # DevServer
        self.llm_url = self.api_url = self.sync_url = ""
        self.temporal_address = ""
        self.env: dict[str, str] = {}         # the RAGLINE_* environment of the API (and of the worker)
        self.worker_env: dict[str, str] = {}  # the worker's, as it runs now (restarts may add to it)
        self.sync_threads: int | None = None  # the sync app's thread pool (it reports it)
        self.api_key: dict | None = None      # the bench's API key entry (without the key)

    @property
    def settings(self):  # noqa: ANN201 - ragline.settings.Settings
        """The settings the benchmarked API runs with: built from the environment it was started with."""
        return config.settings_from_env(self.env)

    @property
    def worker_settings(self):  # noqa: ANN201
        return config.settings_from_env(self.worker_env)

    async def start(self, delay: float) -> None:
        from devtools.devserver import DevServer
        from ragline.settings import Settings

        py = sys.executable
        llm_port, api_port, sync_port = free_port(), free_port(), free_port()
        t_port, ui_port = temporal_ports()
        self.temporal_address = f"{LOOPBACK}:{t_port}"
        self.llm_url = f"http://{LOOPBACK}:{llm_port}"
        self.api_url = f"http://{LOOPBACK}:{api_port}"
        self.sync_url = f"http://{LOOPBACK}:{sync_port}"

        log(f"scripted model on {self.llm_url} (delay {delay:g} s)")
        llm = self._spawn("scripted-llm", [py, "-m", "devtools.scripted_llm", "--host", LOOPBACK, "--port",
                                           str(llm_port), "--delay", str(delay)], {})
        await llm.wait_ready(http_ok(f"{self.llm_url}/v1/models"), 30)

        # The children get no RAGLINE_* of ours besides these (procs.child_env): everything else is the
        # default of ragline.settings, and the report reads every limit from Settings built from this.
        env = {"RAGLINE_DATA_DIR": str(self.data_dir), "RAGLINE_TEMPORAL_ADDRESS": self.temporal_address,
               "RAGLINE_TEMPORAL_UI_PORT": str(ui_port), "RAGLINE_TASK_QUEUE": "ragline",
               "RAGLINE_LLM_BASE_URL": f"{self.llm_url}/v1", "RAGLINE_LLM_MODEL": "scripted",
               "RAGLINE_LLM_API_KEY": "unused", "RAGLINE_API_HOST": LOOPBACK, "RAGLINE_API_PORT": str(api_port),
               # Orchestration is what is measured: every turn answers through the model, none from the
               # cache, and the made-up passages are not held to the relevance gate (bench.quality is).
               "RAGLINE_RELEVANCE_THRESHOLD": "0", "RAGLINE_ANSWER_CACHE_SIZE": "0",
               # The scripted model stands in for a hosted endpoint (on loopback, it would count as local).
               "RAGLINE_LLM_LOCAL": "false"}
        if "max_streams_per_key" in Settings.model_fields:
            env[config.env_name("max_streams_per_key")] = str(STREAMS_PER_KEY)
        # The worker serves its metrics on a port of its own (the default one may be taken on a shared machine).
        if "worker_metrics_port" in Settings.model_fields:
            env[config.env_name("worker_metrics_port")] = str(free_port())
        self.env = dict(env)
        self.worker_env = dict(env)
        settings = self.settings
        self._create_api_key(settings)
        log(f"Temporal dev server on {self.temporal_address} (data in {self.data_dir})")
        self.temporal = DevServer(settings, startup_timeout=60)
        await self.temporal.start()
        server = self.temporal
        atexit.register(lambda: server.running() and os.killpg(server.pid, signal.SIGKILL))

        log("Ragline worker (python worker.py)")
        worker = self._spawn("worker", [py, "worker.py"], env)
        log(f"Ragline API on {self.api_url} (uvicorn, 1 worker)")
        api = self._spawn("api", [py, "-m", "uvicorn", "api.app:app", "--host", LOOPBACK, "--port", str(api_port),
                                  "--workers", "1", "--no-access-log", "--log-level", "warning", *KEEP_ALIVE], env)
        log(f"sync baseline on {self.sync_url} (uvicorn, 1 worker)")
        sync = self._spawn("sync-app", [py, "-m", "uvicorn", "bench.sync_app:app", "--host", LOOPBACK, "--port",
                                        str(sync_port), "--workers", "1", "--no-access-log", "--log-level", "warning", *KEEP_ALIVE],
                           {"BENCH_LLM_BASE_URL": f"{self.llm_url}/v1", "BENCH_LLM_MODEL": "scripted"})
        log(f"floor worker (python -m bench.floor_worker, task queue {FLOOR_QUEUE})")
        floor = self._spawn("floor-worker", [py, "-m", "bench.floor_worker", "--address", self.temporal_address,
                                             "--task-queue", FLOOR_QUEUE], {})
        await sync.wait_ready(http_ok(f"{self.sync_url}/healthz"), 60)
        try:
            async with httpx.AsyncClient(timeout=5, trust_env=False) as c:
                self.sync_threads = (await c.get(f"{self.sync_url}/limits")).json().get("threads")
        except (httpx.HTTPError, ValueError):
            self.sync_threads = None
        # /healthz says "up" only once the worker polls the task queue.
        await api.wait_ready(http_ok(f"{self.api_url}/healthz", body_check=lambda r: r.json()["status"] == "up"), 120)
        await floor.wait_ready(self._logged(floor, floor_worker.READY_LINE), 60)
        if not worker.alive():
            raise RuntimeError(f"the worker exited:\n{worker.log_tail()}")

    def _create_api_key(self, settings) -> None:  # noqa: ANN001
        """One key for the bench, in the keys file the API reads (ragline.keys), if this version has keys.
        Its own requests per minute (API_KEY_RPM): the bench sends far more than a client would."""
        if "api_keys_file" not in type(settings).model_fields:
            return
        from ragline import keys

        path = settings.effective_api_keys_file
        key = keys.create(path, TENANT, role="reviewer", name="bench", requests_per_minute=API_KEY_RPM)
        if "max_running_jobs" in keys.TenantLimits.model_fields:
            with path.open("a") as f:
                f.write(f"\n[tenants.{TENANT}]\nmax_running_jobs = {TENANT_MAX_RUNNING_JOBS}\n")
        procs.register_api_key(self.api_url, key)
        self.api_key = {"tenant": TENANT, "role": "reviewer", "requests_per_minute": API_KEY_RPM,
                        "max_running_jobs": TENANT_MAX_RUNNING_JOBS,
                        "file": str(path.relative_to(self.data_dir)) if path.is_relative_to(self.data_dir) else str(path)}
        log(f"API key for tenant '{TENANT}' (reviewer, {API_KEY_RPM:,} requests per minute) in {path}")

    @staticmethod
    def _logged(proc: Proc, line: str):  # noqa: ANN205
        async def check() -> bool:
            return proc.log_path.exists() and line in proc.log_path.read_text(errors="replace")
        return check

    async def restart_worker(self, extra_env: dict[str, str], name: str = "worker-faults") -> None:
        """Stop the worker and start another one with `extra_env` added to the API's environment; ready
        once it logs `worker polling`."""
        old = next(p for p in reversed(self.procs) if p.name.startswith("worker"))
        await old.stop()
        self.procs.remove(old)
        self.worker_env = {**self.env, **extra_env}
        worker = self._spawn(name, [sys.executable, "worker.py"], self.worker_env)
        await worker.wait_ready(self._logged(worker, "worker polling"), 120)

    def _spawn(self, name: str, argv: list[str], extra_env: dict[str, str]) -> Proc:
        proc = Proc(name, argv, child_env(extra_env), self.log_dir)
        self.procs.append(proc)
        return proc

    async def stop(self) -> None:
        for proc in reversed(self.procs):
            try:
                await proc.stop()
            except BaseException:  # noqa: BLE001 - keep stopping the others
                proc.kill()
        if self.temporal is not None:
            try:
                await self.temporal.stop()
            except BaseException:  # noqa: BLE001
                if self.temporal.running():
                    os.killpg(self.temporal.pid, signal.SIGKILL)

    # scripted model knobs
    async def llm_control(self, **knobs: Any) -> dict:
        async with httpx.AsyncClient(timeout=10, trust_env=False) as c:
            r = await c.post(f"{self.llm_url}/_control", json=knobs)
            r.raise_for_status()
            return r.json()

    async def llm_stats(self, calls: bool = False) -> dict:
        async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
            r = await c.get(f"{self.llm_url}/_stats", params={"calls": "1" if calls else "0"})
            r.raise_for_status()
            return r.json()


# --------------------------------------------------------------------------------------------------
# Ragline helpers


async def wait_job(http: httpx.AsyncClient, job_id: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        r = await http.get(f"/v1/jobs/{job_id}")
        if r.status_code == 200:
            job = r.json()
            if job["status"] in TERMINAL:
                return job
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job_id} not finished after {timeout:.0f} s: {r.status_code} {r.text[:300]}")
        await asyncio.sleep(0.25)


async def ingest(api_url: str) -> dict:
    async with procs.client(api_url, 60) as http:
        r = await http.post("/v1/documents", data={"collection": COLLECTION},
                            files=[("files", ("bench.txt", DOCUMENT.encode(), "text/plain"))])
        if r.status_code != 202:
            raise RuntimeError(f"upload refused: {r.status_code} {r.text[:300]}")
        job = await wait_job(http, r.json()["job_id"], 300)  # the first embedding loads the model
        if job["status"] != "completed":
            raise RuntimeError(f"ingestion ended {job['status']}: {job.get('error')}")
        return job


def chat_body(i: int, tag: str) -> dict:
    return {"message": f"{QUESTION} (#{i})", "collection": COLLECTION, "session_id": f"{tag}-{i}"}


def answered_by_model(job: dict) -> bool:
    result = job.get("result") or {}
    return job.get("status") == "completed" and result.get("model") == "scripted" \
        and not str(result.get("answer", "")).startswith("I don't know")


async def warm_up(stack: Stack, client) -> None:  # noqa: ANN001
    """A few of each call with the model delay at 0: imports, sandbox, pools and caches get warm."""
    await stack.llm_control(delay=0)
    run = uuid.uuid4().hex[:8]
    async with procs.client(stack.api_url, 60) as http:
        replies = await asyncio.gather(*(http.post("/v1/chats", json=chat_body(i, f"warm-{run}")) for i in range(3)))
        for r in replies:
            if r.status_code != 202:
                raise RuntimeError(f"warm-up chat refused: {r.status_code} {r.text[:300]}")
        jobs = await asyncio.gather(*(wait_job(http, r.json()["job_id"], 120) for r in replies))
        for job in jobs:
            if not answered_by_model(job):
                raise RuntimeError(f"warm-up chat did not get a model answer: {json.dumps(job)[:800]}")
    async with procs.client(stack.sync_url, 60) as http:
        for r in await asyncio.gather(*(http.post("/v1/chats", json=chat_body(i, "warm")) for i in range(5))):
            r.raise_for_status()
    await asyncio.gather(*(client.start_workflow(NOOP_WORKFLOW, id=f"bench-noop-warm-{run}-{i}", task_queue=NOOP_QUEUE)
                           for i in range(5)))
    # The event stream (SSE) path and the floor worker, once each.
    async with procs.client(stack.api_url, 60) as http:
        t = await chat_turn(http, chat_body(0, f"warm-sse-{run}"), 60)
        if not t.completed or t.first_delta is None:
            raise RuntimeError(f"warm-up chat on its event stream: {t.as_dict()}")
    for i in range(3):
        await client.execute_workflow(floor_worker.WORKFLOW, "warm", id=f"bench-one-step-warm-{run}-{i}",
                                      task_queue=FLOOR_QUEUE, result_type=str)


# --------------------------------------------------------------------------------------------------
# the three bursts and Ragline's end to end


async def floor_burst(client, n: int, timeout: float) -> Burst:  # noqa: ANN001
    run = uuid.uuid4().hex[:8]

    async def call(i: int):
        handle = await client.start_workflow(NOOP_WORKFLOW, id=f"bench-noop-{run}-{i}", task_queue=NOOP_QUEUE)
        return True, None, handle.id

    return await burst("floor", n, call, timeout)


async def http_burst(name: str, base_url: str, n: int, expect: int, timeout: float, tag: str) -> Burst:
    async with http_client(base_url, n, timeout) as http:
        async def call(i: int):
            r = await http.post("/v1/chats", json=chat_body(i, tag))
            try:
                body = r.json()
            except ValueError:
                body = r.text[:200]
            return r.status_code == expect, r.status_code, body

        return await burst(name, n, call, timeout)


async def raw_burst(name: str, base_url: str, n: int, expect: int, timeout: float, tag: str) -> Burst:
    """The same burst as http_burst with the light client (bench/rawhttp.py): each request prebuilt as
    bytes and written on a connection opened before the burst starts."""
    headers = procs.api_headers(base_url)
    requests = [rawhttp.build_request(base_url, "POST", "/v1/chats", chat_body(i, tag), headers) for i in range(n)]
    conns = [rawhttp.Connection(base_url) for _ in range(n)]
    await asyncio.gather(*(c.open() for c in conns))
    try:
        async def call(i: int):
            status, body = await conns[i].send(requests[i])
            return status == expect, status, body

        return await burst(name, n, call, timeout)
    finally:
        await asyncio.gather(*(c.close() for c in conns))


async def drain(api_url: str, d: Drain, posted: dict[str, float], timeout: float, interval: float,
                t0_wall: float) -> Drain:
    """Poll GET /v1/jobs?kind=chat (one visibility query per poll, no load on the worker) until every
    recorded job is terminal; each job's end-to-end time is its close time minus its POST time.
    `posted`: session id -> time the POST was sent (one turn per session)."""
    start = time.monotonic()
    next_note = start + 15
    async with procs.client(api_url, 30) as http:
        while True:
            d.polls += 1
            try:
                r = await http.get("/v1/jobs", params={"kind": "chat", "limit": 1000})
                if r.status_code == 200:
                    for job in r.json()["jobs"]:
                        jid = job["job_id"]
                        session = session_of_turn(jid)
                        if session not in posted or jid in d.done:
                            continue
                        if jid not in d.acked:
                            if session not in d.unacked:
                                continue
                            d.recorded_unacked.add(jid)
                        d.seen[jid] = job
                        if job["status"] in TERMINAL:
                            d.done[jid] = job
                            closed = datetime.fromisoformat(job["updated_at"]).timestamp()
                            d.e2e[jid] = closed - posted[session]
                else:
                    d.poll_errors += 1
            except httpx.HTTPError:
                d.poll_errors += 1
            now = time.monotonic()
            # A turn recorded despite an error answer shows up within seconds; give it 5 s to.
            if len(d.done) >= len(d.recorded) and now - start > 5:
                d.observed_all_at = time.time() - t0_wall
                return d
            if now - start > timeout:
                d.timed_out = True
                return d
            if now >= next_note:
                log(f"  {len(d.done)}/{len(d.recorded)} recorded chat jobs done after {time.time() - t0_wall:.0f} s")
                next_note = now + 15
            await asyncio.sleep(interval)


async def verify(api_url: str, job_ids: list[str]) -> dict:
    """GET /v1/jobs/{id} for every job: completed, answered by the model, retries seen."""
    sem = asyncio.Semaphore(8)
    out = {"checked": 0, "completed": 0, "model_answers": 0, "no_context_answers": 0, "retried_steps": 0,
           "errors": [], "sample_answer": None}
    async with procs.client(api_url, 60) as http:
        async def one(jid: str) -> None:
            async with sem:
                r = await http.get(f"/v1/jobs/{jid}")
            out["checked"] += 1
            if r.status_code != 200:
                out["errors"].append(f"{jid}: HTTP {r.status_code}")
                return
            job = r.json()
            if job["status"] == "completed":
                out["completed"] += 1
            else:
                out["errors"].append(f"{jid}: {job['status']} {job.get('error')}")
            if answered_by_model(job):
                out["model_answers"] += 1
                out["sample_answer"] = out["sample_answer"] or job["result"]["answer"]
            elif job["status"] == "completed":
                out["no_context_answers"] += 1
            out["retried_steps"] += sum(1 for s in job.get("steps", []) if (s.get("attempts") or 1) > 1)

        await asyncio.gather(*(one(j) for j in job_ids))
    out["errors"] = out["errors"][:10]
    return out


# --------------------------------------------------------------------------------------------------


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_cpu(pid: int) -> float | None:
    """utime + stime of a process in seconds (Linux /proc), None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return None


def _machine_busy() -> float | None:
    """CPU seconds all processes of the machine have been busy (Linux /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (v[0] + v[1] + v[2] + v[5] + v[6]) / _TICK  # user nice system irq softirq
    except (OSError, ValueError, IndexError):
        return None


def cpu_snapshot(stack: Stack) -> dict[str, float]:
    pids = {p.name: p.pid for p in stack.procs}
    if stack.temporal is not None and stack.temporal.pid:
        pids["temporal"] = stack.temporal.pid
    out = {name: _proc_cpu(pid) for name, pid in pids.items()}
    t = os.times()
    out["bench client"] = t.user + t.system
    out["_machine"] = _machine_busy()
    return {k: v for k, v in out.items() if v is not None}


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds per process of the bench between two snapshots, and `other processes`: what the rest
    of the machine used meanwhile (other people's tests, say), which would skew the numbers."""
    # A process started in between (a restarted worker, the local model) counts from 0.
    out = {k: round(after[k] - before.get(k, 0.0), 2) for k in after if k != "_machine"}
    if "_machine" in before and "_machine" in after:
        out["other processes"] = round(max(0.0, after["_machine"] - before["_machine"] - sum(out.values())), 2)
    return out


def call_order(stats: dict) -> dict:
    """From the model server's call records: when the answer calls and the side-step calls (summarize,
    extract_entities) started, in seconds after the first model call, and how many side-step calls
    started before half of the answer calls had."""
    calls = stats.get("calls") or []
    side = sorted(c["started_at"] for c in calls if c.get("task") in ("summarize", "extract_entities"))
    answers = sorted(c["started_at"] for c in calls if c.get("task") == "answer")
    if not side or not answers:
        return {}
    first = min(c["started_at"] for c in calls)
    half = answers[(len(answers) - 1) // 2]
    return {"answers": len(answers), "answers_from": answers[0] - first, "answers_to": answers[-1] - first,
            "answers_half": half - first, "side_before_half": sum(1 for x in side if x < half),
            "side": len(side), "side_from": side[0] - first, "side_to": side[-1] - first}


def machine_facts() -> dict:
    def cmd(argv: list[str]) -> str:
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=10, cwd=ROOT).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    cpu = ""
    try:
        cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
    except OSError:
        pass
    mem_gb = None
    try:
        kb = next(int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("MemTotal"))
        mem_gb = round(kb / 1024 / 1024, 1)
    except (OSError, StopIteration, ValueError):
        pass
    from importlib.metadata import version
    from devtools.devserver import temporal_binary

    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "cpu": cpu, "mem_gb": mem_gb, "os": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(), "temporalio": version("temporalio"),
            "temporal_cli": cmd([temporal_binary(), "--version"]).replace("temporal version ", ""),
            "uvicorn": version("uvicorn"), "fastapi": version("fastapi"), "openai": version("openai"),
            "commit": cmd(["git", "rev-parse", "--short", "HEAD"]),
            "dirty": _dirty(cmd(["git", "status", "--porcelain", "--untracked-files=no"]))}


def _dirty(porcelain: str) -> list[str]:
    """Tracked files with uncommitted changes that the measured code may include (not bench/ nor docs)."""
    paths = [line[3:].strip() for line in porcelain.splitlines() if len(line) > 3]
    return sorted(p for p in paths if p.endswith((".py", ".toml")) and not p.startswith(("tests/", "bench/")))


SETTINGS_SHOWN = ("temporal_rpc_timeout", "llm_concurrency", "llm_requests_per_second", "llm_timeout",
                  "llm_max_tokens", "worker_io_concurrency", "worker_cpu_concurrency", "rate_limit_per_minute",
                  "tenant_max_running_jobs", "max_streams_per_key", "encrypt_payloads", "redact_pii")


def settings_digest(env: dict[str, str]) -> dict:
    """What the report says about limits, all read from the Settings the process builds from `env`."""
    s = config.settings_from_env(env)
    return {"lines": config.describe(s, env, SETTINGS_SHOWN),
            "rpc_timeout": s.temporal_rpc_timeout, "rpc_timeout_name": config.env_name("temporal_rpc_timeout"),
            "llm_slots": config.llm_slots(s), "llm_slots_text": config.llm_slots_text(s, env),
            "llm_timeout": s.llm_timeout, "llm_timeout_name": config.env_name("llm_timeout"),
            "llm_max_tokens": s.llm_max_tokens, "llm_model": s.llm_model,
            "env": {k: v for k, v in sorted(env.items()) if k not in ("RAGLINE_LLM_API_KEY",)}}


async def acceptance(stack: Stack, client, args: argparse.Namespace, results: dict) -> None:  # noqa: ANN001
    """The three bursts of N concurrent requests, and Ragline's end to end (the first section)."""
    n = args.requests
    cpu: dict[str, dict] = results.setdefault("cpu_seconds", {})
    await stack.llm_control(delay=args.delay, clear_calls=True)
    log(f"[1/3] floor: {n} concurrent start_workflow('{NOOP_WORKFLOW}') on an unpolled task queue")
    before = cpu_snapshot(stack)
    floor = await floor_burst(client, n, args.request_timeout)
    cpu["floor"] = cpu_delta(before, cpu_snapshot(stack))
    log(f"      p50 {report.ms(floor.summary()['p50'])}, errors {len(floor.errors)}")
    await asyncio.sleep(1)

    log(f"[2/3] sync app: {n} concurrent POST /v1/chats (each waits for the {args.delay:g} s model)")
    await stack.llm_control(clear_calls=True)
    before = cpu_snapshot(stack)
    sync = await http_burst("sync", stack.sync_url, n, 200, args.request_timeout, f"sync-{uuid.uuid4().hex[:8]}")
    cpu["sync"] = cpu_delta(before, cpu_snapshot(stack))
    sync_llm = await stack.llm_stats()
    log(f"      p50 {report.ms(sync.summary()['p50'])}, wall {sync.wall:.1f} s, errors {len(sync.errors)}")
    await asyncio.sleep(1)

    log(f"[3/3] Ragline: {n} concurrent POST /v1/chats (distinct sessions)")
    await stack.llm_control(clear_calls=True)
    tag = f"rl-{uuid.uuid4().hex[:8]}"
    before = cpu_snapshot(stack)
    ragline = await http_burst("ragline", stack.api_url, n, 202, args.request_timeout, tag)
    after_burst = cpu_snapshot(stack)
    cpu["ragline"] = cpu_delta(before, after_burst)
    log(f"      p50 {report.ms(ragline.summary()['p50'])}, wall {ragline.wall:.2f} s, errors {len(ragline.errors)}")
    posted = {f"{tag}-{x.index}": x.wall_start for x in ragline.samples}
    acked = {x.body["job_id"] for x in ragline.ok}
    t0_wall = min(x.wall_start for x in ragline.samples)
    d = Drain(acked=acked, unacked={f"{tag}-{x.index}" for x in ragline.errors})
    e2e: Drain | None = None
    checked: dict | None = None
    if args.e2e_timeout > 0:
        log(f"waiting for Ragline's chat jobs (3 model calls each; polling GET /v1/jobs every "
            f"{args.poll_interval:g} s, at most {args.e2e_timeout:.0f} s)")
        e2e = await drain(stack.api_url, d, posted, args.e2e_timeout, args.poll_interval, t0_wall)
        cpu["ragline_drain"] = cpu_delta(after_burst, cpu_snapshot(stack))
        log(f"checking every recorded job with GET /v1/jobs/{{id}} ({len(e2e.recorded)})")
        checked = await verify(stack.api_url, sorted(e2e.recorded))
    ragline_stats = await stack.llm_stats(calls=True)

    # The same Ragline burst again with the light client, so that the client's own CPU is not what is
    # measured (httpx's 200 connections cost as much CPU as the API). Its turns are terminated, not run.
    # The floor moves by a third from one burst to the next on this machine: each light burst follows a
    # floor burst of its own, and the rounds are pooled.
    raws, raw_floors, raw_rounds, raw_cpu = [], [], [], []
    for k in range(args.light_rounds):
        await asyncio.sleep(1)
        log(f"[4/4] round {k + 1}/{args.light_rounds}: floor, then Ragline with the light client (prebuilt "
            f"requests on connections opened beforehand): {n} concurrent each")
        raw_floors.append(await floor_burst(client, n, args.request_timeout))
        await asyncio.sleep(1)
        raw_tag = f"rl-raw-{uuid.uuid4().hex[:8]}"
        before = cpu_snapshot(stack)
        raw = await raw_burst("ragline_raw", stack.api_url, n, 202, args.request_timeout, raw_tag)
        raw_cpu.append(cpu_delta(before, cpu_snapshot(stack)))
        raws.append(raw)
        raw_rounds.append({"floor_p50": raw_floors[-1].summary()["p50"], "p50": raw.summary()["p50"],
                           "floor_p99": raw_floors[-1].summary()["p99"], "p99": raw.summary()["p99"],
                           "errors": len(raw.errors)})
        log(f"      floor p50 {report.ms(raw_rounds[-1]['floor_p50'])}, Ragline p50 {report.ms(raw_rounds[-1]['p50'])}, "
            f"wall {raw.wall:.2f} s, errors {len(raw.errors)}")
        raw_ids = [x.body["job_id"] for x in raw.ok] + [session_workflow_id(TENANT, f"{raw_tag}-{i}") for i in range(n)]
        await ratios._terminate(client, raw_ids)
        await settle(stack)
    if raw_cpu:  # per burst, the mean of the rounds
        names = {name for used in raw_cpu for name in used}
        cpu["ragline_raw"] = {name: round(sum(used.get(name, 0.0) for used in raw_cpu) / len(raw_cpu), 2)
                              for name in names}
    results.update({"floor": floor.summary(), "sync": sync.summary(), "ragline": ragline.summary(),
                    "ragline_raw": Burst.pooled("ragline_raw", raws).summary() if raws else None,
                    "floor_raw": Burst.pooled("floor_raw", raw_floors).summary() if raws else None,
                    "raw_rounds": raw_rounds,
                    "sync_llm": _llm_digest(sync_llm), "ragline_llm": _llm_digest(ragline_stats),
                    "ragline_call_order": call_order(ragline_stats),
                    "e2e": _e2e_digest(e2e, posted, t0_wall) if e2e else None, "verify": checked})


async def scripted_prompt(stack: Stack) -> list[dict] | None:
    """The messages the answer step sends for QUESTION in a fresh session, from the scripted model's records
    (one turn at the current model knobs)."""
    await stack.llm_control(clear_calls=True)
    async with procs.client(stack.api_url, 120) as http:
        t = await chat_turn(http, {"message": QUESTION, "collection": COLLECTION,
                                   "session_id": f"prompt-{uuid.uuid4().hex[:8]}"}, 120)
    if not t.completed:
        raise RuntimeError(f"the turn that records the answer prompt did not complete: {t.as_dict()}")
    return ratios.recorded_prompt(await stack.llm_stats(calls=True), QUESTION)


class LocalModelSkipped(Exception):
    """No local model file here (nor a way to fetch one): the phase that needs it says why and is skipped."""


@contextlib.asynccontextmanager
async def local_model(stack: Stack, key: str | None, threads: int | None = None):
    """llama.cpp with the local model `key` (the default one when None), and the worker restarted against it
    as `make run` gives it the local server; the worker goes back to the scripted model after. Yields the
    server's base URL and the llama.cpp command line; raises LocalModelSkipped."""
    from devtools.localmodel import LocalModelError, ensure_model, llama_server_argv
    from ragline.settings import Settings

    key = key or Settings.model_fields["local_model"].default
    folder, why = ratios.local_model_file(ROOT, key)
    if folder is None:
        raise LocalModelSkipped(why)
    port = free_port()
    extra_threads = {config.env_name("local_model_threads"): str(threads)} if threads else {}
    llm_settings = config.settings_from_env({config.env_name("local_model"): key,
                                             config.env_name("llm_port"): str(port), **extra_threads})
    try:
        model_path = ensure_model(llm_settings, models_dir=folder, log=log)
    except LocalModelError as exc:
        raise LocalModelSkipped(str(exc)) from exc
    log(f"[local] llama.cpp with {model_path.name} on port {port}")
    argv = llama_server_argv(llm_settings, model_path)
    llama = stack._spawn("llama", argv, {})
    base_url = llm_settings.effective_llm_base_url
    try:
        await llama.wait_ready(http_ok(f"{base_url}/models"), 300)
        # What `make run` gives the worker for the local server: its base URL, and the llm slots that
        # ragline.settings gives a local llama.cpp server (RAGLINE_LLM_BASE_URL unset).
        local_slots = config.settings_from_env({}).effective_llm_concurrency
        model_name = Settings.model_fields["llm_model"].default
        extra = {config.env_name("llm_base_url"): base_url, config.env_name("llm_model"): model_name,
                 config.env_name("llm_concurrency"): str(local_slots), config.env_name("llm_local"): "true"}
        log(f"[local] restarting the worker against it ({', '.join(f'{k}={v}' for k, v in extra.items())})")
        await stack.restart_worker(extra, name="worker-local")
        yield base_url, " ".join(Path(a).name if a.startswith("/") else a for a in argv[1:])
    finally:
        await llama.stop()
        stack.procs.remove(llama)
        if stack.worker_env != stack.env:
            log("[local] restarting the worker against the scripted model again")
            await stack.restart_worker({}, name="worker-scripted")


async def local_phase(stack: Stack, client, args: argparse.Namespace, messages: list[dict]) -> dict:  # noqa: ANN001
    """First answer delta with the local llama.cpp model: the worker restarted against it."""
    from ragline.settings import Settings

    before = cpu_snapshot(stack)
    key = args.local_model or Settings.model_fields["local_model"].default
    try:
        async with local_model(stack, key, args.local_model_threads) as (base_url, llama_argv):
            worker = stack.worker_settings
            log("[local] warm-up: one bare call and one turn")
            from openai import AsyncOpenAI
            oai = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=args.request_timeout)
            try:
                await ratios.bare_stream(oai, worker.llm_model, messages, worker.llm_max_tokens)
            finally:
                await oai.close()
            async with procs.client(stack.api_url, 300) as http:
                t = await chat_turn(http, {"message": QUESTION, "collection": COLLECTION,
                                           "session_id": f"local-warm-{uuid.uuid4().hex[:6]}"}, 300)
            if not t.completed:
                log(f"[local] warm-up turn did not complete: {t.error or t.terminal_type}")
            log(f"[local] {args.local_turns} sequential turns and bare streamed calls (a 1-token call to another "
                f"prompt before each, so llama.cpp's prompt cache helps neither)")
            out = await ratios.first_delta(stack.api_url, client, base_url, worker.llm_model, worker.llm_max_tokens,
                                           messages, args.local_turns, QUESTION, COLLECTION, 300, log, flush=True)
            log(f"[local] {args.local_turns} follow-ups, each asked as the turn before it has its answer")
            out["follow_up"] = await ratios.follow_up(stack.api_url, base_url, worker.llm_model,
                                                      worker.llm_max_tokens, messages, args.local_turns, QUESTION,
                                                      FOLLOW_UP_QUESTION, COLLECTION, 300, log, flush=True)
            out["cpu"] = cpu_delta(before, cpu_snapshot(stack))  # before the model server stops
            out.update(model=key, llama_argv=llama_argv, worker_settings=settings_digest(stack.worker_env))
            return out
    except LocalModelSkipped as skipped:
        log(f"[local] skipped: {skipped}")
        return {"skipped": str(skipped), "model": key}


async def settle(stack: Stack, limit: float = 60.0) -> None:
    """Wait until the scripted model has no call in flight (the terminated turns' last calls end)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if (await stack.llm_stats()).get("in_flight", 0) == 0:
            break
        await asyncio.sleep(0.5)
    log(f"      settled after {time.monotonic() - t0:.1f} s (no model call in flight)")


async def burst_rounds(stack: Stack, client, args: argparse.Namespace) -> dict:  # noqa: ANN001
    """`burst`, round by round: the sync app answers a burst of as many requests, then Ragline takes its burst
    of chats, each followed on its stream. One burst of each differs from the next by seconds on this
    machine, so each Ragline burst is compared with the sync burst right before it and the verdict is the
    median round's; the details shown (segments, model calls) are that round's."""
    n, rounds = args.burst_chats, []
    for k in range(1, args.burst_rounds + 1):
        log(f"[burst {k}/{args.burst_rounds}] sync app: {n} concurrent requests, then Ragline: {n} chats at once, "
            f"model delay {args.delay:g} s, each POST followed by its event stream (SSE) to the end")
        await stack.llm_control(delay=args.delay, stream_chunk_delay=0, clear_calls=True)
        sync = await http_burst("sync", stack.sync_url, n, 200, args.request_timeout, f"bsync-{uuid.uuid4().hex[:8]}")
        await asyncio.sleep(1)
        await stack.llm_control(clear_calls=True)
        out = await measured(stack, ratios.burst_stream(
            stack.api_url, client, n, max(args.e2e_timeout, 60), QUESTION, COLLECTION, log))
        burst_llm = await stack.llm_stats(calls=True)
        out["llm"], out["call_order"] = _llm_digest(burst_llm), call_order(burst_llm)
        out["sync"] = {key: v for key, v in sync.summary().items() if not key.endswith("latencies")}
        log(f"      sync app p50 {report.ms(out['sync']['p50'])}")
        rounds.append(out)
        await asyncio.sleep(1)
    median = sorted(rounds, key=_burst_ratio)[(len(rounds) - 1) // 2]
    summary = [{"first_delta": r["first_delta"], "sync": r["sync"], "completed": r["completed"], "n": r["n"],
                "accept": r["accept"], "terminal": r["terminal"], "cpu": r["cpu"]} for r in rounds]
    return {**median, "round": rounds.index(median) + 1, "rounds": summary}


def _burst_ratio(r: dict) -> float:
    fd, sync = r["first_delta"]["p50"], r["sync"]["p50"]
    return fd / sync if fd is not None and sync else float("inf")


async def measured(stack: Stack, phase) -> dict:  # noqa: ANN001 - a coroutine returning a dict
    """Run a phase; add the CPU seconds each process used meanwhile and the phase's wall time (a phase that
    stops a process of its own puts its CPU time in `cpu` itself)."""
    before = cpu_snapshot(stack)
    t0 = time.monotonic()
    out = await phase
    out.setdefault("cpu", cpu_delta(before, cpu_snapshot(stack)))
    out["phase_wall"] = round(time.monotonic() - t0, 1)
    return out


async def run(args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, task.cancel)

    data_dir = Path(tempfile.mkdtemp(prefix="ragline-bench-"))
    stack = Stack(data_dir)
    ok = interrupted = False
    n = args.requests
    phases = args.phases
    t_begin = time.monotonic()
    try:
        await stack.start(args.delay)
        log("ingesting one small document into collection 'bench' (first embedding loads the model)")
        await ingest(stack.api_url)

        from temporalio.client import Client
        client = await Client.connect(stack.temporal_address, namespace="default")
        log("warm-up with the model delay at 0 (Ragline chats end to end, sync requests, bare starts)")
        await warm_up(stack, client)
        await stack.llm_control(delay=args.delay, clear_calls=True)
        await asyncio.sleep(1)

        results: dict[str, Any] = {
            "params": {"requests": n, "delay": args.delay, "poll_interval": args.poll_interval,
                       "e2e_timeout": args.e2e_timeout, "phases": phases, "burst_chats": args.burst_chats,
                       "burst_rounds": args.burst_rounds,
                       "seq_requests": args.seq_requests, "seq_sessions": args.seq_sessions,
                       "ttfd_turns": args.ttfd_turns, "ttfd_delay": args.ttfd_delay,
                       "ttfd_chunk_delay": args.ttfd_chunk_delay, "overhead_turns": args.overhead_turns,
                       "local_turns": args.local_turns, "argv": sys.argv[1:]},
            "machine": machine_facts(), "settings": settings_digest(stack.env), "api_key": stack.api_key,
            "sync_threads": stack.sync_threads, "cpu_seconds": {}, "bench_seconds": None}
        rt: dict[str, Any] = {}
        results["ratios"] = rt
        if "accept" in phases:
            await acceptance(stack, client, args, results)
        prompt: list[dict] | None = None
        if "ttfd" in phases:
            await stack.llm_control(delay=args.ttfd_delay, stream_chunk_delay=args.ttfd_chunk_delay)
            prompt = await scripted_prompt(stack)
            if prompt is None:
                raise RuntimeError("no recorded answer prompt for the bare streamed call")
            log(f"[ttfd] {args.ttfd_turns} sequential turns and bare streamed calls, scripted model "
                f"(reply after {args.ttfd_delay:g} s, {args.ttfd_chunk_delay:g} s between pieces)")
            ws = stack.worker_settings
            rt["ttfd"] = await measured(stack, ratios.first_delta(
                stack.api_url, client, f"{stack.llm_url}/v1", ws.llm_model, ws.llm_max_tokens, prompt, args.ttfd_turns,
                QUESTION, COLLECTION, 120, log))
            rt["ttfd"]["prompt_chars"] = sum(len(m["content"]) for m in prompt)
            log(f"[ttfd] {args.ttfd_turns} follow-ups, each asked as the turn before it has its answer")
            rt["follow_up"] = await measured(stack, ratios.follow_up(
                stack.api_url, f"{stack.llm_url}/v1", ws.llm_model, ws.llm_max_tokens, prompt, args.ttfd_turns,
                QUESTION, FOLLOW_UP_QUESTION, COLLECTION, 120, log))
        if "overhead" in phases:
            await stack.llm_control(delay=0, stream_chunk_delay=0, clear_calls=True)
            log(f"[overhead] {args.overhead_turns} sequential turns with a 0 s model, and as many bare "
                f"'{floor_worker.WORKFLOW}' workflows (one activity), alternating")
            rt["overhead"] = await measured(stack, ratios.overhead(
                stack.api_url, client, turns=args.overhead_turns, warm=3, floor_workflow=floor_worker.WORKFLOW,
                floor_queue=FLOOR_QUEUE, question=QUESTION, collection=COLLECTION, timeout=120, log=log))
            rt["overhead"]["llm"] = _llm_digest(await stack.llm_stats())
        if "burst" in phases:
            rt["burst"] = await burst_rounds(stack, client, args)
        if "local" in phases:
            await stack.llm_control(delay=0, stream_chunk_delay=0)
            if prompt is None:
                prompt = await scripted_prompt(stack)
            rt["local"] = await measured(stack, local_phase(stack, client, args, prompt))
        if "order" in phases:
            await stack.llm_control(delay=args.delay, stream_chunk_delay=0, clear_calls=True)
            rt["order"] = await measured(stack, ratios.in_order(
                stack, client, tenant=TENANT, sessions=args.seq_sessions, per_session=args.seq_requests // args.seq_sessions,
                timeout=args.request_timeout, question=QUESTION, collection=COLLECTION,
                noop_workflow=NOOP_WORKFLOW, noop_queue=NOOP_QUEUE, log=log))
            await settle(stack)

        results["bench_seconds"] = round(time.monotonic() - t_begin, 1)
        out_dir = ROOT / "bench" / "results"
        out_dir.mkdir(exist_ok=True)
        raw = out_dir / f"chat-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
        raw.write_text(json.dumps(results, indent=2, default=str))
        log(f"raw results in {raw.relative_to(ROOT)}")
        sections = []
        if "accept" in phases:
            sections.append((report.HEADING, report.render(results)))
        if rt:
            sections.append((report.RATIOS_HEADING, report.render_ratios(results)))
        for heading, text in sections:
            print()
            print(text)
            if not args.no_write:
                report.write_section(args.output, text, heading, after=report.HEADING)
                log(f"updated section '{heading}' in {args.output}")
        if "faults" in phases:
            from bench import faults
            fr = await faults.measure(stack, args, QUESTION, COLLECTION, TERMINAL, log)
            text = faults.render(fr, results["machine"])
            print()
            print(text)
            raw = out_dir / f"faults-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
            raw.write_text(json.dumps(fr, indent=2, default=str))
            log(f"raw results in {raw.relative_to(ROOT)}")
            if not args.no_write:
                report.write_section(args.output, text, faults.HEADING)
                log(f"updated section '{faults.HEADING}' in {args.output}")
        ok = True
        return 0
    except (asyncio.CancelledError, KeyboardInterrupt):
        interrupted = True
        raise
    finally:
        log("stopping everything the bench started")
        await stack.stop()
        if (ok or interrupted) and not args.keep_data:
            shutil.rmtree(data_dir, ignore_errors=True)
        else:
            log(f"data and logs kept in {data_dir}")


def _llm_digest(stats: dict) -> dict:
    return {"by_task": stats.get("by_task"), "total": stats.get("total"), "ok": stats.get("ok"),
            "max_concurrency": stats.get("max_concurrency"), "faults": stats.get("faults")}


def _e2e_digest(d: Drain, posted: dict[str, float], t0_wall: float) -> dict:
    lat = sorted(d.e2e.values())
    closes = [posted[session_of_turn(j)] + d.e2e[j] for j in d.e2e]
    recorded = d.recorded
    return {"requests": len(posted), "acked": len(d.acked), "recorded": len(recorded),
            "recorded_despite_error": len(d.recorded_unacked), "done": len(d.done), "statuses": d.statuses(),
            "timed_out": d.timed_out,
            "all_done_after": (max(closes) - t0_wall) if closes and not d.timed_out else None,
            "last_done_after": (max(closes) - t0_wall) if closes else None,
            "first_done_after": (min(closes) - t0_wall) if closes else None,
            "observed_by_polling_after": d.observed_all_at, "polls": d.polls, "poll_errors": d.poll_errors,
            "p50": percentile(lat, 50), "p99": percentile(lat, 99), "max": lat[-1] if lat else None}


def rerender(args: argparse.Namespace) -> int:
    results = json.loads(args.from_results.read_text())
    sections = []
    if results.get("ragline"):
        sections.append((report.HEADING, report.render(results)))
    if results.get("ratios"):
        sections.append((report.RATIOS_HEADING, report.render_ratios(results)))
    for heading, text in sections:
        print(text)
        if not args.no_write:
            report.write_section(args.output, text, heading, after=report.HEADING)
            log(f"updated section '{heading}' in {args.output} from {args.from_results}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_results:
        return rerender(args)
    try:
        return asyncio.run(run(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("\nbench interrupted; everything it started has been stopped", file=sys.stderr)
        return 130
