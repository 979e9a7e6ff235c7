"""`make bench`: chat acceptance latency of Ragline next to a plain synchronous FastAPI app and the
bare Temporal `start_workflow` floor, with a scripted model that answers every chat completion after
`--delay` seconds. Everything runs on loopback in one run, on free ports and a temporary data folder:

  scripted model   python -m devtools.scripted_llm --port L --delay D        (shared by both apps)
  Temporal         devtools.devserver.DevServer (SQLite in the temp folder, WAL)
  Ragline worker   python worker.py                                       (RAGLINE_* env)
  Ragline API      python -m uvicorn api.app:app --workers 1
  sync baseline    python -m uvicorn bench.sync_app:app --workers 1

Phases, in this order: setup + ingest one small document into collection "bench" (so every chat turn
retrieves a passage and really calls the model: summarize, extract_entities, answer), warm-up with the
model delay at 0, then with the delay at D: (1) N concurrent bare start_workflow calls, (2) N concurrent
POST /v1/chats to the sync app, (3) N concurrent POST /v1/chats to Ragline, then wait until Ragline's N
jobs are done (GET /v1/jobs every --poll-interval s) and check every one (GET /v1/jobs/{id}).
Then, on the same stack with the worker restarted with RAGLINE_LLM_TIMEOUT=3, completion under injected
model faults (bench/faults.py; --skip-faults leaves it out).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
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

from bench import report
from bench.measure import Burst, Drain, burst, percentile
from bench.procs import LOOPBACK, ROOT, Proc, child_env, free_port, http_ok, temporal_ports
from workflows.models import turn_job_id

TERMINAL = ("completed", "failed", "cancelled", "dead_lettered")
COLLECTION = "bench"
NOOP_WORKFLOW = "BenchNoop"
NOOP_QUEUE = "bench-noop-unpolled"
QUESTION = "Which company runs the Lisbon data centre, and what does it use for cooling?"
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
    f = p.add_argument_group("completion under injected faults (after the acceptance benchmark)")
    f.add_argument("--fault-chats", type=int, default=40, help="chat turns per fault rate, over 10 sessions (default 40)")
    f.add_argument("--fault-ingests", type=int, default=5, help="small text documents ingested per fault rate (default 5)")
    f.add_argument("--fault-rate", type=float, default=0.12,
                   help="share of model calls that fail in the second run (default 0.12; the first runs at 0)")
    f.add_argument("--fault-delay", type=float, default=0.5, help="model delay during the fault runs (default 0.5 s)")
    f.add_argument("--fault-deadline", type=float, default=600.0, help="max seconds per fault rate (default 600)")
    f.add_argument("--skip-faults", action="store_true", help="only the acceptance benchmark")
    args = p.parse_args(argv)
    if not 0 < args.fault_rate <= 1 or args.fault_chats < 0 or args.fault_ingests < 0 or args.fault_delay < 0:
        p.error("--fault-rate must be within (0, 1], --fault-chats, --fault-ingests and --fault-delay >= 0")
    if not 1 <= args.requests <= 1000:
        p.error("--requests must be within 1..1000 (the load stays bounded)")
    if args.delay < 0 or args.poll_interval <= 0:
        p.error("--delay must be >= 0 and --poll-interval > 0")
    return args


def http_client(base_url: str, n: int, timeout: float) -> httpx.AsyncClient:
    """Room for n connections at once, loopback only (no proxy from the environment)."""
    return httpx.AsyncClient(base_url=base_url, trust_env=False,
                             limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
                             timeout=httpx.Timeout(timeout, connect=60.0))


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
        self.api_deadline = 0.0  # the API's RAGLINE_TEMPORAL_RPC_TIMEOUT
        self.env: dict[str, str] = {}  # the worker's and the API's RAGLINE_* settings

    async def start(self, delay: float) -> None:
        from ragline.settings import Settings
        from devtools.devserver import DevServer

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

        log(f"Temporal dev server on {self.temporal_address} (data in {self.data_dir})")
        settings = Settings(data_dir=self.data_dir, temporal_address=self.temporal_address,
                            temporal_ui_port=ui_port, temporal_namespace="default", task_queue="ragline")
        # The children get no RAGLINE_* of ours besides the ones below: the API runs with the default.
        self.api_deadline = Settings.model_fields["temporal_rpc_timeout"].default
        self.temporal = DevServer(settings, startup_timeout=60)
        await self.temporal.start()
        server = self.temporal
        atexit.register(lambda: server.running() and os.killpg(server.pid, signal.SIGKILL))

        env = {"RAGLINE_DATA_DIR": str(self.data_dir), "RAGLINE_TEMPORAL_ADDRESS": self.temporal_address,
               "RAGLINE_TEMPORAL_UI_PORT": str(ui_port), "RAGLINE_TASK_QUEUE": "ragline",
               "RAGLINE_LLM_BASE_URL": f"{self.llm_url}/v1", "RAGLINE_LLM_MODEL": "scripted",
               "RAGLINE_LLM_API_KEY": "unused", "RAGLINE_API_HOST": LOOPBACK, "RAGLINE_API_PORT": str(api_port)}
        log("Ragline worker (python worker.py)")
        self.env = env
        worker = self._spawn("worker", [py, "worker.py"], env)
        log(f"Ragline API on {self.api_url} (uvicorn, 1 worker)")
        api = self._spawn("api", [py, "-m", "uvicorn", "api.app:app", "--host", LOOPBACK, "--port", str(api_port),
                                  "--workers", "1", "--no-access-log", "--log-level", "warning"], env)
        log(f"sync baseline on {self.sync_url} (uvicorn, 1 worker)")
        sync = self._spawn("sync-app", [py, "-m", "uvicorn", "bench.sync_app:app", "--host", LOOPBACK, "--port",
                                        str(sync_port), "--workers", "1", "--no-access-log", "--log-level", "warning"],
                           {"BENCH_LLM_BASE_URL": f"{self.llm_url}/v1", "BENCH_LLM_MODEL": "scripted"})
        await sync.wait_ready(http_ok(f"{self.sync_url}/healthz"), 60)
        # /healthz says "up" only once the worker polls the task queue.
        await api.wait_ready(http_ok(f"{self.api_url}/healthz", body_check=lambda r: r.json()["status"] == "up"), 120)
        if not worker.alive():
            raise RuntimeError(f"the worker exited:\n{worker.log_tail()}")

    async def restart_worker(self, extra_env: dict[str, str]) -> None:
        """Stop the worker and start another one with `extra_env` added; ready once it logs `worker polling`."""
        old = next(p for p in reversed(self.procs) if p.name.startswith("worker"))
        await old.stop()
        self.procs.remove(old)
        worker = self._spawn("worker-faults", [sys.executable, "worker.py"], {**self.env, **extra_env})

        async def polling() -> bool:
            return worker.log_path.exists() and "worker polling" in worker.log_path.read_text(errors="replace")

        await worker.wait_ready(polling, 120)

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
    async with httpx.AsyncClient(base_url=api_url, timeout=60, trust_env=False) as http:
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
    async with httpx.AsyncClient(base_url=stack.api_url, timeout=60, trust_env=False) as http:
        replies = await asyncio.gather(*(http.post("/v1/chats", json=chat_body(i, f"warm-{run}")) for i in range(3)))
        for r in replies:
            if r.status_code != 202:
                raise RuntimeError(f"warm-up chat refused: {r.status_code} {r.text[:300]}")
        jobs = await asyncio.gather(*(wait_job(http, r.json()["job_id"], 120) for r in replies))
        for job in jobs:
            if not answered_by_model(job):
                raise RuntimeError(f"warm-up chat did not get a model answer: {json.dumps(job)[:800]}")
    async with httpx.AsyncClient(base_url=stack.sync_url, timeout=60, trust_env=False) as http:
        for r in await asyncio.gather(*(http.post("/v1/chats", json=chat_body(i, "warm")) for i in range(5))):
            r.raise_for_status()
    await asyncio.gather(*(client.start_workflow(NOOP_WORKFLOW, id=f"bench-noop-warm-{run}-{i}", task_queue=NOOP_QUEUE)
                           for i in range(5)))


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


async def drain(api_url: str, d: Drain, submitted: dict[str, float], timeout: float, interval: float,
                t0_wall: float) -> Drain:
    """Poll GET /v1/jobs?kind=chat (one visibility query per poll, no load on the worker) until every
    recorded job is terminal; each job's end-to-end time is its close time minus its POST time."""
    start = time.monotonic()
    next_note = start + 15
    watched = d.acked | d.unacked
    async with httpx.AsyncClient(base_url=api_url, timeout=30, trust_env=False) as http:
        while True:
            d.polls += 1
            try:
                r = await http.get("/v1/jobs", params={"kind": "chat", "limit": 1000})
                if r.status_code == 200:
                    for job in r.json()["jobs"]:
                        jid = job["job_id"]
                        if jid not in watched or jid in d.done:
                            continue
                        d.seen[jid] = job
                        if job["status"] in TERMINAL:
                            d.done[jid] = job
                            closed = datetime.fromisoformat(job["updated_at"]).timestamp()
                            d.e2e[jid] = closed - submitted[jid]
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
    async with httpx.AsyncClient(base_url=api_url, timeout=60, trust_env=False) as http:
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
    out = {k: round(after[k] - before[k], 2) for k in after if k in before and k != "_machine"}
    if "_machine" in before and "_machine" in after:
        out["other processes"] = round(max(0.0, after["_machine"] - before["_machine"] - sum(out.values())), 2)
    return out


def call_order(stats: dict) -> dict:
    """From the model server's call records: how many `answer` calls started before the last
    summarize/extract_entities call started (FIFO activity dispatch puts almost all of them after)."""
    calls = stats.get("calls") or []
    prep = [c["started_at"] for c in calls if c.get("task") in ("summarize", "extract_entities")]
    answers = [c["started_at"] for c in calls if c.get("task") == "answer"]
    if not prep or not answers:
        return {}
    last_prep = max(prep)
    first = min(c["started_at"] for c in calls)
    return {"answers": len(answers), "answers_before_last_prep": sum(1 for a in answers if a < last_prep),
            "last_prep_started_after": round(last_prep - first, 1)}


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


def _worker_io_slots() -> int | None:
    """The worker's activity slots for model calls, if this version of the settings has the knob."""
    from ragline.settings import Settings

    field = Settings.model_fields.get("worker_io_concurrency")
    return field.default if field is not None else None


def _dirty(porcelain: str) -> list[str]:
    """Tracked files with uncommitted changes that the measured code may include (not bench/ nor docs)."""
    paths = [line[3:].strip() for line in porcelain.splitlines() if len(line) > 3]
    return sorted(p for p in paths if p.endswith((".py", ".toml")) and not p.startswith(("tests/", "bench/")))


async def run(args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, task.cancel)

    data_dir = Path(tempfile.mkdtemp(prefix="ragline-bench-"))
    stack = Stack(data_dir)
    ok = interrupted = False
    n = args.requests
    t_begin = time.monotonic()
    try:
        await stack.start(args.delay)
        log("ingesting one small document into collection 'bench' (first embedding loads the model)")
        await ingest(stack.api_url)

        from temporalio.client import Client
        client = await Client.connect(stack.temporal_address, namespace="default")
        log("warm-up with the model delay at 0 (3 Ragline chats end to end, 5 sync requests, 5 bare starts)")
        await warm_up(stack, client)
        await stack.llm_control(delay=args.delay, clear_calls=True)
        await asyncio.sleep(1)

        cpu: dict[str, dict] = {}
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
        submitted = {turn_job_id(f"{tag}-{s.index}", 1): s.wall_start for s in ragline.samples}
        acked = {s.body["job_id"] for s in ragline.ok}
        submitted.update({s.body["job_id"]: s.wall_start for s in ragline.ok})
        t0_wall = min(s.wall_start for s in ragline.samples)
        d = Drain(acked=acked, unacked=set(submitted) - acked)
        e2e: Drain | None = None
        checked: dict | None = None
        if args.e2e_timeout > 0:
            log(f"waiting for Ragline's chat jobs (3 model calls each; polling GET /v1/jobs every "
                f"{args.poll_interval:g} s, at most {args.e2e_timeout:.0f} s)")
            e2e = await drain(stack.api_url, d, submitted, args.e2e_timeout, args.poll_interval, t0_wall)
            cpu["ragline_drain"] = cpu_delta(after_burst, cpu_snapshot(stack))
            log(f"checking every recorded job with GET /v1/jobs/{{id}} ({len(e2e.recorded)})")
            checked = await verify(stack.api_url, sorted(e2e.recorded))
        ragline_stats = await stack.llm_stats(calls=True)

        results = {"params": {"requests": n, "delay": args.delay, "poll_interval": args.poll_interval,
                              "e2e_timeout": args.e2e_timeout},
                   "machine": machine_facts(),
                   "floor": floor.summary(), "sync": sync.summary(), "ragline": ragline.summary(),
                   "sync_llm": _llm_digest(sync_llm), "ragline_llm": _llm_digest(ragline_stats),
                   "ragline_call_order": call_order(ragline_stats), "cpu_seconds": cpu,
                   "e2e": _e2e_digest(e2e, submitted, t0_wall) if e2e else None, "verify": checked,
                   "api_deadline": stack.api_deadline, "worker_io_slots": _worker_io_slots(),
                   "bench_seconds": None}
        results["bench_seconds"] = round(time.monotonic() - t_begin, 1)
        text = report.render(results)
        print()
        print(text)
        out_dir = ROOT / "bench" / "results"
        out_dir.mkdir(exist_ok=True)
        raw = out_dir / f"chat-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
        raw.write_text(json.dumps(results, indent=2, default=str))
        log(f"raw results in {raw.relative_to(ROOT)}")
        if not args.no_write:
            report.write_section(args.output, text)
            log(f"updated section '{report.HEADING}' in {args.output}")
        if not args.skip_faults:
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


def _e2e_digest(d: Drain, submitted: dict[str, float], t0_wall: float) -> dict:
    lat = sorted(d.e2e.values())
    closes = [submitted[j] + d.e2e[j] for j in d.e2e]
    recorded = d.recorded
    return {"requests": len(submitted), "acked": len(d.acked), "recorded": len(recorded),
            "recorded_despite_error": len(recorded - d.acked), "done": len(d.done), "statuses": d.statuses(),
            "timed_out": d.timed_out,
            "all_done_after": (max(closes) - t0_wall) if closes and not d.timed_out else None,
            "last_done_after": (max(closes) - t0_wall) if closes else None,
            "first_done_after": (min(closes) - t0_wall) if closes else None,
            "observed_by_polling_after": d.observed_all_at, "polls": d.polls, "poll_errors": d.poll_errors,
            "p50": percentile(lat, 50), "p99": percentile(lat, 99), "max": lat[-1] if lat else None}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(run(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("\nbench interrupted; everything it started has been stopped", file=sys.stderr)
        return 130
