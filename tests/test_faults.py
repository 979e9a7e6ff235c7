"""Proof under faults: flaky providers, killed workers and a restarted Temporal server lose and
duplicate nothing.

The tests that turn server-wide knobs of the scripted model (random faults, a delay on every request)
get a model of their own (`private_llm`); the one on the session's shared stack scopes its calls by a
token in its question."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path


from devtools.devserver import DevServer
from temporal import schedules
from tests.conftest import FIXTURES, SHARED_CODEC_KEYS, free_server_port, running_stack
from tests.helpers import assert_nothing_lost_or_doubled, eventually, session_turns
from tests.pdfgen import pdf_bytes

PROJECT = Path(__file__).resolve().parent.parent
TRANSIENT = ["429", "503", "drop", "hang", "malformed"]
FACT = "The {n}th harbour has a lighthouse painted {colour} and a keeper named Keeper{n}."
COLOURS = ["red", "green", "blue", "white", "yellow"]


def _doc(n: int, pages: int = 3) -> bytes:
    return pdf_bytes([FACT.format(n=n, colour=COLOURS[(n + p) % 5]) + f" Page {p} of document {n}."
                      for p in range(1, pages + 1)])


def _shipped_attempts(tmp_path: Path) -> Path:
    """The test suite's short backoffs with the attempts temporal/policies.toml ships for model and
    embedding calls (6): at 12 % faults, 4 attempts (the suite's default) fail some call of a run about
    once in 50 runs (0.12**4 per call), 6 about once in 4,000."""
    fast = (FIXTURES.parent / "fast_policies.toml").read_text()
    assert fast.count("\nmax_attempts = 4\n") == 1, "tests/fast_policies.toml changed its default attempts"
    path = tmp_path / "fault_policies.toml"
    path.write_text(fast.replace("\nmax_attempts = 4\n", "\nmax_attempts = 6\n"))
    return path


async def _all_done(stack, job_ids: list[str], timeout: float) -> list[dict]:
    return await asyncio.gather(*(stack.wait_job(j, timeout=timeout) for j in job_ids))


async def test_twelve_percent_transient_faults_everywhere(temporal_env, private_llm, tmp_path, restore_policies):
    """Every model and embedding call may fail (429 + Retry-After, 503, dropped connection, hang past
    the timeout, malformed JSON): 30 chats and 10 ingestions all complete."""
    llm = private_llm
    address = temporal_env.client.service_client.config.target_host
    async with running_stack(address, llm, tmp_path, task_queue="ragline-faults",
                             embeddings_base_url=llm.base_url, embeddings_model="scripted",
                             embeddings_timeout=3, policies=_shipped_attempts(tmp_path)) as stack:
        llm.set_faults(rate=0.12, kinds=TRANSIENT, seed=12, retry_after=0.2)
        uploads = [await stack.upload((f"h{n}.pdf", _doc(n)), collection="faults") for n in range(10)]
        ingest_jobs = await _all_done(stack, [u["job_id"] for u in uploads], timeout=300)
        assert [j["status"] for j in ingest_jobs] == ["completed"] * 10, ingest_jobs
        sessions = [f"f-{uuid.uuid4().hex[:6]}" for _ in range(10)]
        chats = await asyncio.gather(*(stack.chat(f"What colour is the lighthouse of harbour {i}?",
                                                  session_id=sessions[i % 10], collection="faults")
                                       for i in range(30)))
        chat_jobs = await _all_done(stack, [c["job_id"] for c in chats], timeout=400)
        assert [j["status"] for j in chat_jobs] == ["completed"] * 30, [j for j in chat_jobs if j["status"] != "completed"]
        # Each answer is a reply the model completed for that question, whatever failed around it.
        for job in chat_jobs:
            replies = {c.reply.strip() for c in llm.calls_for("answer") if c.ok
                       and c.question == job["result"]["question"]}
            assert job["result"]["answer"] in replies, (job["result"], replies)
        faults = [c for c in llm.calls if c.fault]
        assert {c.fault for c in faults} >= {"429", "503"} and len(faults) >= 10, len(faults)
        retried = [s for j in chat_jobs for s in j["steps"] if s["attempts"] > 1]
        assert retried, "no step needed a retry: the faults did not reach the chain"


def _worker_process(settings_env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "worker.py"], cwd=PROJECT, env={**os.environ, **settings_env},
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


async def test_sigkilled_worker_loses_and_duplicates_nothing(temporal_env, private_llm, tmp_path):
    """SIGKILL the worker at two random moments with 20 ingestions and 20 chat turns in flight; each kill
    comes while a model call is in flight, and the test checks that calls were indeed cut off."""
    scripted_llm = private_llm
    address = temporal_env.client.service_client.config.target_host
    queue = "ragline-kill"
    env = {"RAGLINE_DATA_DIR": str(tmp_path), "RAGLINE_TEMPORAL_ADDRESS": address, "RAGLINE_TASK_QUEUE": queue,
           "RAGLINE_CODEC_KEYS_FILE": str(SHARED_CODEC_KEYS),  # the keys of the test's API (running_stack)
           "RAGLINE_LLM_BASE_URL": scripted_llm.base_url, "RAGLINE_LLM_MODEL": "scripted",
           "RAGLINE_LLM_TIMEOUT": "3", "RAGLINE_POLICIES": str(FIXTURES.parent / "fast_policies.toml"),
           "RAGLINE_EMBED_BATCH_SIZE": "4",
           "RAGLINE_WORKER_METRICS_PORT": "0"}  # not the default port, which a running `make run` holds
    log = tmp_path / "worker.log"
    rng = random.Random(20)
    kills: list[float] = []

    async def model_call_in_flight() -> bool:
        return any(c.finished_at is None for c in scripted_llm.calls_for())

    async with running_stack(address, scripted_llm, tmp_path, in_process_worker=False, task_queue=queue) as stack:
        scripted_llm.set_delay(0.4)
        worker = _worker_process(env, log)
        try:
            # Chats go to a collection already indexed, so their answers need the model. Uploaded first, it
            # is indexed before the 20 uploads behind it, which the kills then find in flight.
            seed = await stack.upload(("seed.txt", b"Lighthouses guide ships. Keepers light them at dusk."),
                                      collection="killchat")
            uploads = await asyncio.gather(*(stack.upload((f"k{n}.pdf", _doc(n, pages=4)), collection="kill")
                                             for n in range(20)))
            await stack.wait_job(seed["job_id"])
            # Two sessions of ten turns: a session runs its turns one after another, so model calls are
            # still in flight for the second kill, after the worker's restart.
            sessions = [f"k-{uuid.uuid4().hex[:6]}" for _ in range(2)]
            chats = await asyncio.gather(*(stack.chat(f"Question {i}: who lights the lighthouses?",
                                                      session_id=sessions[i % 2], collection="killchat")
                                           for i in range(20)))
            for _ in range(2):
                await asyncio.sleep(rng.uniform(1.0, 4.0))
                # At a moment when the worker is waiting on the model (each reply takes 0.4 s): the kill
                # cuts that call off. (The worker comes back within seconds; chats are still queued.)
                await eventually(model_call_in_flight, timeout=60, every=0.01,
                                 what="a model call in flight to kill the worker during")
                kills.append(time.monotonic())
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
                worker = _worker_process(env, log)
            ingest_jobs = await _all_done(stack, [u["job_id"] for u in uploads], timeout=400)
            chat_jobs = await _all_done(stack, [c["job_id"] for c in chats], timeout=400)
        finally:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()

        assert [j["status"] for j in ingest_jobs] == ["completed"] * 20
        assert [j["status"] for j in chat_jobs] == ["completed"] * 20
        # The worker process keeps the blob sweep's daily schedule, for its own task queue.
        sweep = stack.client.get_schedule_handle(schedules.BLOB_SWEEP)
        try:
            described = await sweep.describe()
            assert (described.schedule.action.workflow, described.schedule.action.task_queue) == \
                ("BlobSweepWorkflow", queue)
        finally:
            await sweep.delete()
        # Qdrant holds exactly the expected points, and every turn was answered once, in order.
        await assert_nothing_lost_or_doubled(stack, "kill", ingest_jobs, sessions, turns=10)
        # The kills mattered: each one cut off a model call in flight (the worker's connection dropped
        # before the reply was sent), and the step it belonged to was retried to completion.
        chat_calls = [c for c in scripted_llm.calls if c.endpoint == "chat" and c.question.startswith("Question ")]
        for kill in kills:
            cut = [c for c in chat_calls if c.cut_off and c.started_at < kill <= c.finished_at]
            assert cut, f"the kill at {kill:.2f} interrupted no model call"
            for call in cut:
                assert any(c.ok and c.question == call.question and c.task == call.task and c.started_at > kill
                           for c in chat_calls), f"the cut-off {call.task} call for {call.question!r} was never redone"
        # No step ran again after it had completed: a repeated model call for the same question and
        # step is only allowed when the earlier one was cut off by a kill.
        by_step: dict[tuple[str, str], list] = {}
        for call in scripted_llm.calls:
            if call.endpoint == "chat" and call.question.startswith("Question "):
                by_step.setdefault((call.question, call.task), []).append(call)
        for key, calls in by_step.items():
            completed = [c for c in calls if c.ok]
            assert completed, key
            for earlier in completed[:-1]:
                later = completed[completed.index(earlier) + 1]
                assert any(earlier.started_at < k < later.started_at for k in kills), (
                    f"{key} completed twice without a kill in between")


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of `pid` is stopped (state T in /proc): a SIGSTOP takes each thread as it next runs."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            continue  # a thread that ended meanwhile
    return bool(states) and all(state in ("T", "t") for state in states)


async def test_temporal_restart_mid_run(private_llm, tmp_path):
    """SIGTERM the Temporal server mid-run and start it again on the same file: every job completes.
    While it is down, POSTs answer 503 and /healthz says why. Frozen before that (SIGSTOP: it takes the
    requests and answers none), a POST answers 504 and names the job it would have started."""
    from ragline.settings import Settings

    scripted_llm = private_llm
    port = free_server_port()
    server_settings = Settings(data_dir=tmp_path / "temporal", temporal_address=f"127.0.0.1:{port}",
                               temporal_ui_port=port + 5)
    server = DevServer(server_settings)
    await server.start()
    try:
        async with running_stack(server_settings.temporal_address, scripted_llm, tmp_path / "stack",
                                 task_queue="ragline-restart", temporal_rpc_timeout=3) as stack:
            scripted_llm.set_delay(0.5)
            ingest = await stack.upload(*[(f"r{n}.pdf", _doc(n)) for n in range(3)], collection="restart")
            await stack.wait_job(ingest["job_id"])
            chats = [await stack.chat(f"Restart question {i}?", collection="restart") for i in range(4)]
            second = await stack.upload(("late.pdf", _doc(99, pages=6)), collection="restart")

            os.kill(server.pid, signal.SIGSTOP)
            await eventually(lambda: asyncio.sleep(0, _all_threads_stopped(server.pid)), timeout=10,
                             what="every thread of the server stopped")  # (on a busy machine, not at once)
            try:
                frozen = await stack.http.post("/v1/chats", json={"message": "frozen?", "collection": "restart"})
                read = await stack.http.get(f"/v1/jobs/{chats[0]['job_id']}")
            finally:
                os.kill(server.pid, signal.SIGCONT)
            # Not "nothing recorded" (a resend would ask twice): the server may record it once it wakes.
            assert frozen.status_code == 504, frozen.text
            error = frozen.json()["error"]
            assert error["code"] == "temporal_timeout" and "may have been recorded" in error["message"], error
            assert error["status_url"] == f"{stack.base_url}/v1/jobs/{error['job_id']}", error
            # What it says to do tells the truth: the job is there, or 404 and no turn of its session has it.
            look = await stack.http.get(f"/v1/jobs/{error['job_id']}")
            if look.status_code == 200:
                chats.append({"job_id": error["job_id"]})
            else:
                assert look.json()["error"]["code"] == "job_not_found", look.text
            assert read.status_code == 504 and "try again" in read.json()["error"]["message"], read.text
            assert "job_id" not in read.json()["error"], read.text

            await server.stop()
            down = await stack.http.post("/v1/chats", json={"message": "anyone there?", "collection": "restart"})
            assert down.status_code == 503 and down.json()["error"]["code"] == "temporal_unavailable"
            # Which job it would have been, and how to send it again safely: a start may be recorded as it fails.
            assert down.json()["error"]["status_url"] == f"{stack.base_url}/v1/jobs/{down.json()['error']['job_id']}"
            assert "same Idempotency-Key" in down.json()["error"]["message"], down.text
            health = await stack.http.get("/healthz")
            assert health.status_code == 503
            assert "Temporal" in health.json()["components"]["temporal"]["reason"]
            # The probes' endpoint keeps the process in service meanwhile: it is what answers the 503s.
            assert (await stack.http.get("/livez")).json() == {"status": "up"}

            await server.start()
            scripted_llm.set_delay(0)
            jobs = await _all_done(stack, [c["job_id"] for c in chats] + [second["job_id"]], timeout=300)
            assert [j["status"] for j in jobs] == ["completed"] * len(jobs), jobs
            assert (await stack.http.get("/healthz")).status_code == 200
    finally:
        await server.stop()


async def test_hundred_concurrent_identical_requests_run_one_chain(stack):
    seed = await stack.upload(("idem.txt", b"Idempotency keys make retries safe."), collection="idem100")
    await stack.wait_job(seed["job_id"])
    session = f"i100-{uuid.uuid4().hex[:6]}"
    with stack.llm.scope() as llm:
        question = f"What makes retries safe? {llm.token}"
        bodies = await asyncio.gather(*(stack.chat(question, session_id=session, collection="idem100",
                                                   idempotency_key="same-key") for _ in range(100)))
        assert len({b["job_id"] for b in bodies}) == 1
        job = await stack.wait_job(bodies[0]["job_id"])
        assert job["status"] == "completed"
        # A later turn of the same session runs only after every earlier one: once it is done, a
        # duplicate chain of the first request would have run already.
        later = await stack.chat(f"And what else? {llm.token}", session_id=session, collection="idem100",
                                 idempotency_key="other-key")
        assert (await stack.wait_job(later["job_id"]))["status"] == "completed"
        for task in ("answer", "summarize", "extract_entities"):
            assert [c.question for c in llm.calls(task)].count(question) == 1, task
    assert job["turn"] == 1 and job["result"]["answer"]
    turns = await session_turns(stack.http, session, job["job_id"], later["job_id"])
    assert [t["job_id"] for t in turns] == [job["job_id"], later["job_id"]]
