"""Rolling out a new build while sessions are open (README "Rolling out a new build while sessions are
open"), live on the dev server: two builds of the same code as two versions of one worker deployment,
switched with the `temporal worker deployment set-current-version` command the README gives, and
the old one found drained with `describe-version`.

What a team relies on: once the new build is current, new jobs run on it; an open chat session and a
turn waiting for its review move to it (AUTO_UPGRADE); a job pinned to the old build (an evaluation,
mid-flight during the switch) finishes there, and the old build reads `drained` only after it has."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import uuid
from datetime import timedelta

import pytest
from temporalio import common, workflow
from temporalio.api.enums.v1 import VersioningBehavior
from temporalio.api.workflowservice.v1 import DescribeWorkerDeploymentRequest
from temporalio.common import WorkerDeploymentVersion
from temporalio.worker import Worker, WorkerDeploymentConfig

import worker as worker_module
from devtools.devserver import temporal_binary
from models.chat import session_workflow_id
from ragline.vectorstore import open_index
from temporal.deployment import current_build, make_first_build_current
from tests.conftest import running_stack
from tests.helpers import eventually, waiting_reviews
from worker import build_worker

DEFINITION = "__temporal_workflow_definition"


@pytest.fixture
def versioning_behaviors_put_back():
    """A versioned worker gives each workflow class its behaviour (worker.VERSIONING_BEHAVIORS), process
    wide; the test session's other, unversioned workers must not inherit it."""
    saved = {cls: getattr(cls, DEFINITION) for cls in worker_module.VERSIONING_BEHAVIORS}
    yield
    for cls, defn in saved.items():
        setattr(cls, DEFINITION, defn)
        setattr(defn.run_fn, DEFINITION, defn)


async def set_current_version(settings, build_id: str) -> None:
    """README step 2, as an operator types it."""
    said = []

    async def attempt() -> bool:
        proc = await asyncio.create_subprocess_exec(
            temporal_binary(), "worker", "deployment", "set-current-version",
            "--deployment-name", settings.worker_deployment_name, "--build-id", build_id,
            "--address", settings.temporal_address, "--namespace", settings.temporal_namespace, "--yes",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await proc.communicate()
        said.append(out.decode(errors="replace").strip())
        return proc.returncode == 0

    # Refused until the version's workers have polled every task queue of the deployment.
    try:
        await eventually(attempt, timeout=30, every=0.5, what=f"set-current-version {build_id}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the CLI said: {said[-1]}") from None


async def drainage(settings, build_id: str) -> str:
    """README step 3, as an operator types it: the version's drainage status ("" before it has one)."""
    proc = await asyncio.create_subprocess_exec(
        temporal_binary(), "worker", "deployment", "describe-version",
        "--deployment-name", settings.worker_deployment_name, "--build-id", build_id,
        "--address", settings.temporal_address, "--namespace", settings.temporal_namespace, "--output", "json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode(errors="replace")
    return str(json.loads(out).get("drainageInfo", {}).get("drainageStatus", "")).lower()


async def drainage_reads(settings, build_id: str, status: str) -> None:
    """Until the version's drainage status reads `status` (the server sets it just after a switch)."""
    async def reads() -> bool:
        return (await drainage(settings, build_id)).endswith(status)  # e.g. VERSION_DRAINAGE_STATUS_DRAINED

    await eventually(reads, timeout=60, every=0.5, what=f"build {build_id} {status}")


async def versioning(stack, job_id: str) -> tuple[int, str]:
    """The job's versioning behaviour and the build its last workflow task ran on."""
    info = (await stack.client.get_workflow_handle(job_id).describe()).raw_description.workflow_execution_info
    return info.versioning_info.behavior, info.versioning_info.deployment_version.build_id


async def test_a_new_build_takes_new_jobs_and_open_sessions_while_a_pinned_job_finishes_on_the_old(
        temporal_env, scripted_llm, tmp_path, versioning_behaviors_put_back, restore_policies):
    address = temporal_env.client.service_client.config.target_host
    uid = uuid.uuid4().hex[:8]
    async with running_stack(address, scripted_llm, tmp_path, in_process_worker=False,
                             task_queue=f"rollout-{uid}", worker_deployment_name=f"ragline-rollout-{uid}",
                             llm_timeout=30) as stack:  # room for the slow call below
        index = open_index(stack.settings)
        executor = concurrent.futures.ThreadPoolExecutor(max_workers=8)
        builds = {}

        async def start_build(build_id: str) -> None:
            settings = stack.settings.model_copy(update={"worker_build_id": build_id})
            built = build_worker(stack.client, settings, index, executor)
            builds[build_id] = (built, asyncio.create_task(built.run()))

        try:
            await start_build("1.0")
            await set_current_version(stack.settings, "1.0")
            # README step 1: the new build polls beside the old one, and gets nothing until it is current.
            await start_build("2.0")

            # On the old build: a document, a session whose turn waits for its review, and an
            # evaluation whose model call is under way when the new build becomes current.
            r = await stack.http.post("/v1/documents", data={"collection": "rollout"}, files={"files": (
                "lighthouse.txt", f"The {uid} lighthouse is painted red and white and has 120 steps.".encode())})
            assert r.status_code == 202, r.text
            assert (await stack.wait_job(r.json()["job_id"]))["status"] == "completed"
            session = f"rollout-{uid}"
            r = await stack.http.post("/v1/chats", json={"message": "How many steps has the lighthouse?",
                                                        "collection": "rollout", "session_id": session,
                                                        "require_review": True})
            assert r.status_code == 202, r.text
            held = r.json()["job_id"]
            [review] = await waiting_reviews(stack, held)
            assert await versioning(stack, held) == (VersioningBehavior.VERSIONING_BEHAVIOR_AUTO_UPGRADE, "1.0")

            with scripted_llm.scope() as mine:
                mine.set_delay(5.0)  # the switch happens while this call is in flight
                golden = json.dumps({"question": f"How many steps has the lighthouse? {mine.token}",
                                     "expected_document": "lighthouse.txt"})
                r = await stack.http.post("/v1/evaluations?collection=rollout&answers=true", content=golden.encode())
                assert r.status_code == 202, r.text
                evaluation = r.json()["job_id"]
                await mine.wait_for_calls(1, task="answer", timeout=60)

                await set_current_version(stack.settings, "2.0")  # README step 2
                assert not (await mine.wait_for_calls(1, task="answer"))[0].finished_at  # still in flight
                # README step 3: the old build is not to be scaled down while a pinned job runs on it.
                await drainage_reads(stack.settings, "1.0", "draining")

                # Pinned: the evaluation finishes on the build that started it.
                assert (await stack.wait_job(evaluation))["status"] == "completed"
                assert await versioning(stack, evaluation) == (VersioningBehavior.VERSIONING_BEHAVIOR_PINNED, "1.0")
            # ... and says so once its last pinned job has ended: the old workers may go.
            await drainage_reads(stack.settings, "1.0", "drained")

            # A new session's turn runs on the new build.
            r = await stack.http.post("/v1/chats", json={"message": "What colours is the lighthouse?",
                                                        "collection": "rollout"})
            fresh = r.json()["job_id"]
            assert (await stack.wait_job(fresh))["status"] == "completed"
            assert await versioning(stack, fresh) == (VersioningBehavior.VERSIONING_BEHAVIOR_AUTO_UPGRADE, "2.0")

            # The turn that waited for its review moves to the new build with the decision, and so does its
            # session with the next turn.
            r = await stack.http.post(f"/v1/jobs/{review['job_id']}/review",
                                      json={"decision": "approve", "reviewer": "ops"})
            assert r.status_code == 200, r.text
            assert (await stack.wait_done(held))["status"] == "completed"
            assert await versioning(stack, held) == (VersioningBehavior.VERSIONING_BEHAVIOR_AUTO_UPGRADE, "2.0")
            r = await stack.http.post("/v1/chats", json={"message": "And the colours?", "collection": "rollout",
                                                        "session_id": session})
            assert (await stack.wait_job(r.json()["job_id"]))["status"] == "completed"
            assert (await versioning(stack, session_workflow_id(stack.tenant, session)))[1] == "2.0"
        finally:
            for built, task in builds.values():
                await built.shutdown()
                await task
            executor.shutdown(wait=False, cancel_futures=True)
            index.close()


@workflow.defn(name="RolloutProbe", sandboxed=False)
class _Probe:
    @workflow.run
    async def run(self) -> None:
        return None


async def test_a_first_deploys_build_is_made_current_but_not_over_an_operators_unversioned(temporal_env):
    """A first deploy has no current version: the workflows role makes its build current (else no job runs).
    An operator who later sets the deployment unversioned (`set-current-version --unversioned`) means it:
    a versioned worker's restart must not make its build current again."""
    client = temporal_env.client
    uid = uuid.uuid4().hex[:8]
    deployment, queue = f"ragline-first-{uid}", f"first-{uid}"

    def versioned(build_id: str) -> Worker:
        return Worker(client, task_queue=queue, workflows=[_Probe], deployment_config=WorkerDeploymentConfig(
            version=WorkerDeploymentVersion(deployment_name=deployment, build_id=build_id),
            use_worker_versioning=True, default_versioning_behavior=common.VersioningBehavior.PINNED))

    async with versioned("1.0"):
        assert await make_first_build_current(client, deployment, "1.0", patience=timedelta(seconds=30)) == "1.0"
        proc = await asyncio.create_subprocess_exec(
            temporal_binary(), "worker", "deployment", "set-current-version", "--deployment-name", deployment,
            "--unversioned", "--address", client.service_client.config.target_host, "--yes",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await proc.communicate()
        assert proc.returncode == 0, out.decode(errors="replace")
        found = await current_build(client, deployment)
        assert found is not None and found[0] is None
    async with versioned("1.1"):  # a pod of the next build starts
        async def known() -> bool:  # its pollers made it known: the server would take it as current now
            described = await client.workflow_service.describe_worker_deployment(DescribeWorkerDeploymentRequest(
                namespace=client.namespace, deployment_name=deployment))
            versions = described.worker_deployment_info.version_summaries
            return "1.1" in {v.deployment_version.build_id for v in versions}
        await eventually(known, timeout=30, what="build 1.1 known to the server")
        assert await make_first_build_current(client, deployment, "1.1", patience=timedelta(seconds=5)) is None
        assert (await current_build(client, deployment))[0] is None
