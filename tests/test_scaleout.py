"""Proof on one machine: RAGLINE_WORKERS=workflows:1,cpu:1,llm:2,vector:1 as separate `worker.py --role`
processes of one versioned build (a first deploy: no build current yet) on a dev server, a model that answers
after 1 s, and SIGKILLed workers mid-run: every job completes, Qdrant holds exactly the expected points, and
no model call is repeated after it completed.
(Throughput, 1 versus 2 llm workers, is measured by `make bench`, bench/scaleout.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from activities.gate import gate_id
from devtools.supervisor import ProcessSpec, worker_specs
from ragline.errors import StoreUnavailableError
from ragline.settings import Settings
from ragline.vectorstore import open_index
from tests.conftest import FIXTURES, SHARED_CODEC_KEYS, running_stack
from tests.helpers import assert_nothing_lost_or_doubled, eventually
from tests.pdfgen import pdf_bytes

PROJECT = Path(__file__).resolve().parent.parent
WORKERS = "workflows:1,cpu:1,llm:2,vector:1"


class Fleet:
    """The worker processes of RAGLINE_WORKERS, started from the supervisor's own specs."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env = env
        self.log_dir = log_dir
        self.specs = {s.name: s for s in worker_specs(Settings(**_settings_kwargs(env)), {})}
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str) -> None:
        spec: ProcessSpec = self.specs[name]
        log = (self.log_dir / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(list(spec.argv), cwd=PROJECT, env={**os.environ, **self.env, **spec.env},
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def stop(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.stop(name)


def _settings_kwargs(env: dict[str, str]) -> dict[str, str]:
    return {k[len("RAGLINE_"):].lower(): v for k, v in env.items() if k.startswith("RAGLINE_")}


async def _gate_standing(stack, queue: str) -> str:
    """The tenant gate's holders and line, each with its job's status: what a stuck `queued` job waits on."""
    try:
        state = await stack.client.get_workflow_handle(gate_id(stack.tenant, queue)).query("slots")
    except Exception as exc:  # noqa: BLE001 - a diagnostic must not hide the failure it explains
        return f"the gate could not be queried: {exc!r}"
    state = state if isinstance(state, dict) else state.model_dump()

    async def status(workflow_id: str) -> str:
        try:
            return (await stack.client.get_workflow_handle(workflow_id).describe()).status.name
        except Exception as exc:  # noqa: BLE001
            return repr(exc)

    holders = {j: await status(j) for j in state["holders"]}
    waiting = {j: await status(j) for j in state["waiting"]}
    return f"gate limit {state['limit']}: holders {holders}; waiting {waiting}"


def _doc(n: int) -> bytes:
    return pdf_bytes([f"Harbour {n} keeps a {colour} lighthouse; page {p} of scale document {n}."
                      for p, colour in enumerate(["red", "green", "blue"], 1)])


async def test_workers_by_role_survive_sigkill_with_exact_counts(temporal_env, private_llm, tmp_path):
    address = temporal_env.client.service_client.config.target_host
    queue = f"scale-{uuid.uuid4().hex[:6]}"
    env = {"RAGLINE_DATA_DIR": str(tmp_path), "RAGLINE_TEMPORAL_ADDRESS": address, "RAGLINE_TASK_QUEUE": queue,
           "RAGLINE_CODEC_KEYS_FILE": str(SHARED_CODEC_KEYS),  # the keys of the test's API (running_stack)
           "RAGLINE_LLM_BASE_URL": private_llm.base_url, "RAGLINE_LLM_MODEL": "scripted",
           "RAGLINE_LLM_TIMEOUT": "5", "RAGLINE_LLM_CONCURRENCY": "4",
           "RAGLINE_POLICIES": str(FIXTURES.parent / "fast_policies.toml"), "RAGLINE_EMBED_BATCH_SIZE": "4",
           "RAGLINE_WORKERS": WORKERS, "RAGLINE_WORKER_METRICS_PORT": "0", "PYTHONUNBUFFERED": "1",
           # plumbing under test, with made-up texts: every turn answers through the model
           "RAGLINE_RELEVANCE_THRESHOLD": "0", "RAGLINE_ANSWER_CACHE_SIZE": "0",
           # A first deploy of a versioned fleet, as deploy/k8s/config.yaml sets it: no operator step makes the
           # build current (the workflows worker does, the deployment having none), and every job runs.
           "RAGLINE_WORKER_BUILD_ID": "1.0", "RAGLINE_WORKER_DEPLOYMENT_NAME": f"ragline-{queue}"}
    fleet = Fleet(env, tmp_path)
    assert sorted(fleet.specs) == ["worker-cpu", "worker-llm-1", "worker-llm-2", "worker-vector", "worker-workflows"]
    kills: list[float] = []
    async with running_stack(address, private_llm, tmp_path, in_process_worker=False, task_queue=queue) as stack:
        private_llm.set_delay(0.5)
        try:
            for name in fleet.specs:
                fleet.start(name)

            async def every_queue_polled() -> dict | None:
                # Pollers per queue: an operator key's view
                operator = {"Authorization": f"Bearer {stack.keys['operator']}"}
                health = (await stack.http.get("/healthz", headers=operator)).json()
                health = health["components"]["worker"]
                # (up, too, while a queue nobody polls has nothing waiting: a role scaled to zero)
                polled = all(q["activity_pollers"] and q.get("workflow_pollers") != 0
                             for q in health["queues"].values())
                # Both llm processes: the second may poll a moment after the first made every queue polled.
                both_llm = health["queues"].get(f"{queue}-llm", {}).get("activity_pollers", 0) >= 2
                return health if health["status"] == "up" and polled and both_llm else None

            await eventually(every_queue_polled, timeout=60, every=0.5, what="pollers on every queue, two on llm")

            # The store belongs to the vector process: a second one, or this test, gets the one-line error.
            second = subprocess.run([sys.executable, "worker.py", "--role", "vector"], cwd=PROJECT, timeout=60,
                                    env={**os.environ, **env}, capture_output=True, text=True)
            assert second.returncode == 3
            assert "already open in another process" in second.stdout + second.stderr
            try:
                open_index(stack.settings).close()
                raise AssertionError("the embedded store opened twice")
            except StoreUnavailableError as exc:
                assert "RAGLINE_QDRANT_URL" in exc.message

            seed = await stack.upload(("seed.txt", b"Keepers light the lighthouses at dusk, every day."),
                                      collection="scalechat")
            assert (await stack.wait_job(seed["job_id"], timeout=60))["status"] == "completed"

            uploads = await asyncio.gather(*(stack.upload((f"s{n}.pdf", _doc(n)), collection="scale")
                                             for n in range(20)))
            sessions = [f"s-{uuid.uuid4().hex[:6]}" for _ in range(10)]
            chats = []
            for turn in range(4):
                chats += await asyncio.gather(*(stack.chat(f"Question {turn}-{i}: who lights the lighthouses?",
                                                           session_id=sessions[i], collection="scalechat")
                                                for i in range(10)))
            # Mid-run: SIGKILL one llm worker and the cpu worker, then start them again.
            await eventually(lambda: _asyncify(private_llm.count(ok_only=True) >= 6), timeout=60,
                             what="model calls under way")
            for name in ("worker-llm-1", "worker-cpu"):
                kills.append(time.monotonic())
                fleet.kill(name)
            await asyncio.sleep(1.0)
            for name in ("worker-llm-1", "worker-cpu"):
                fleet.start(name)

            try:
                ingest_jobs = await asyncio.gather(*(stack.wait_job(u["job_id"], timeout=240) for u in uploads))
                chat_jobs = await asyncio.gather(*(stack.wait_job(c["job_id"], timeout=240) for c in chats))
            except AssertionError as exc:
                # A job stuck `queued` once, not reproduced since: name who held the tenant's slots then.
                raise AssertionError(f"{exc}\n{await _gate_standing(stack, queue)}") from None
        finally:
            private_llm.set_delay(0)
            fleet.stop_all()

        assert [j["status"] for j in ingest_jobs] == ["completed"] * 20, ingest_jobs
        assert [j["status"] for j in chat_jobs] == ["completed"] * 40, [j for j in chat_jobs if j["status"] != "completed"]
        # With the vector process stopped, the store opens here: exactly the expected points.
        await assert_nothing_lost_or_doubled(stack, "scale", ingest_jobs, sessions)
        # No model call repeated after it completed, unless a kill cut off the earlier run's report.
        by_step: dict[tuple[str, str], list] = {}
        for call in private_llm.calls:
            if call.endpoint == "chat" and call.question.startswith("Question "):
                by_step.setdefault((call.question, call.task), []).append(call)
        assert len({q for q, task in by_step if task == "answer"}) == 40
        for key, calls in by_step.items():
            completed = [c for c in calls if c.ok]
            assert completed, key
            for earlier, later in zip(completed, completed[1:]):
                assert any(earlier.started_at < k < later.started_at for k in kills), (
                    f"{key} completed twice without a kill in between")


async def _asyncify(value):
    return value
