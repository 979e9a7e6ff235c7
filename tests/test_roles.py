"""Worker roles, the supervisor's RAGLINE_WORKERS, and the settings that move Ragline from `make run`
to a cluster (Temporal TLS / API key, a Qdrant server): built and checked without any network."""

from __future__ import annotations

import socket

import concurrent.futures
import os
import re
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from temporalio.service import TLSConfig

import worker
from devtools.supervisor import temporal_is_local, worker_specs
from ragline import metrics
from ragline.settings import Settings
from ragline.vectorstore import open_index
from temporal import policies, queues
from temporal.client import connect, connect_options
from temporal.telemetry import ServerStatsPoller, worker_runtime
from tests.conftest import FIXTURES, free_port
from tests.helpers import eventually

# policies.load is process-wide: put back what the session's in-process worker runs on.
pytestmark = pytest.mark.usefixtures("restore_policies")

PROJECT = Path(__file__).resolve().parent.parent
FAST = FIXTURES.parent / "fast_policies.toml"


# -- RAGLINE_WORKERS and the supervisor --------------------------------------------------------------

def test_workers_setting_becomes_processes_per_role(tmp_path):
    settings = Settings(data_dir=tmp_path, workers="workflows:1,cpu:1,llm:2,vector:1")
    assert settings.worker_processes == [("workflows", 1), ("cpu", 1), ("llm", 2), ("vector", 1)]
    specs = worker_specs(settings, {"RAGLINE_LLM_BASE_URL": "http://model"})
    assert [(s.name, list(s.argv[1:])) for s in specs] == [
        ("worker-vector", ["worker.py", "--role", "vector"]),
        ("worker-workflows", ["worker.py", "--role", "workflows"]),
        ("worker-cpu", ["worker.py", "--role", "cpu"]),
        ("worker-llm-1", ["worker.py", "--role", "llm"]),
        ("worker-llm-2", ["worker.py", "--role", "llm"]),
    ]
    assert all(s.env["RAGLINE_LLM_BASE_URL"] == "http://model" for s in specs)
    # Each process serves its metrics on its own port, from RAGLINE_WORKER_METRICS_PORT on.
    ports = [int(s.env["RAGLINE_WORKER_METRICS_PORT"]) for s in specs]
    assert ports == list(range(settings.worker_metrics_port, settings.worker_metrics_port + len(specs)))
    # Unset: today's single process, role all.
    [single] = worker_specs(Settings(data_dir=tmp_path))
    assert (single.name, list(single.argv[1:])) == ("worker", ["worker.py"])


def test_a_worker_metrics_port_already_taken_stops_make_run_with_the_setting_to_change(tmp_path):
    """Taken by another program (a second stack), the worker would serve no metrics while the banner
    named the port, and Prometheus would scrape the other program."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for settings in (Settings(data_dir=tmp_path, worker_metrics_port=port),
                         Settings(data_dir=tmp_path, worker_metrics_port=port, workers="all:1,llm:1")):
            problem = worker_specs(settings)[0].preflight()
            assert f"127.0.0.1:{port} is already in use" in problem and "RAGLINE_WORKER_METRICS_PORT" in problem
    assert worker_specs(Settings(data_dir=tmp_path, worker_metrics_port=port))[0].preflight() is None
    assert worker_specs(Settings(data_dir=tmp_path, worker_metrics_port=0))[0].preflight is None


@pytest.mark.parametrize("value, message", [
    ("cpu:1,llm:1,vector:1", "no process polls the main queue"),
    ("workflows:1,cpu:1,llm:1", "no process polls the vector queue"),
    ("workflows:1,cpu:1,llm:1,vector:2", "embedded Qdrant store can be opened by one process only"),
    ("all:1,vector:1", "embedded Qdrant store can be opened by one process only"),
    ("workflows:1,gpu:1", "unknown role 'gpu'"),
    ("workflows:x", "whole number"),
    ("llm:1,llm:2", "given twice"),
])
def test_a_topology_that_cannot_work_is_refused_with_the_reason(tmp_path, value, message):
    with pytest.raises(ValueError, match=message):
        Settings(data_dir=tmp_path, workers=value).worker_processes


def test_with_a_qdrant_server_the_vector_role_scales_too(tmp_path):
    settings = Settings(data_dir=tmp_path, workers="workflows:2,cpu:3,llm:4,vector:2",
                        qdrant_url="http://qdrant:6333")
    assert dict(settings.worker_processes) == {"workflows": 2, "cpu": 3, "llm": 4, "vector": 2}


def test_make_run_starts_a_dev_server_only_for_a_local_address():
    assert temporal_is_local("127.0.0.1:7233") and temporal_is_local("localhost:7233")
    assert not temporal_is_local("temporal-frontend.temporal.svc:7233")
    assert not temporal_is_local("ragline.a2b3c.tmprl.cloud:7233")


# -- which role runs what ------------------------------------------------------------------------------

def test_each_role_runs_exactly_what_the_policy_file_routes_to_its_queues():
    policies.load(policies.DEFAULT_FILE, worker.activity_names())
    served = {role: worker.served_activities(role) for role in queues.ROLES}
    assert served["llm"] == {"generate_answer", "generate_answer_fallback", "summarize_context", "extract_entities",
                             "agent_plan"}
    assert served["cpu"] == {"extract_text", "chunk_text", "embed_chunks"}
    assert served["vector"] == {"index_chunks", "prune_stale_chunks", "remove_document_chunks", "retrieve_context",
                                "search_documents",
                                "search_chunks", "cache_answer", "evaluate_collection"}
    assert served["workflows"] == {"await_document", "confirm_removal", "forget_document",
                                   "await_turn", "acquire_slot", "release_slot", "ended_jobs", "sweep_blobs",
                                   "await_newer_run", "policy_attempts", "session_still_runs", "session_left"}
    assert served["all"] == set(worker.activity_names())
    # Only the vector role opens the store; the llm role and the workflow role load no embedding model. The
    # model is called by the llm role and by the vector role's evaluations (each gets its key on a cluster).
    assert {r: worker.role_needs(r) for r in queues.ROLES} == {
        "all": {"index", "embedder", "model"}, "vector": {"index", "embedder", "model"}, "cpu": {"embedder"},
        "llm": {"model"}, "workflows": set()}


def test_a_store_activity_outside_the_vector_queue_stops_a_role_that_does_not_own_the_store(tmp_path):
    text = FAST.read_text().replace('[activities.index_chunks]\nqueue = "vector"', '[activities.index_chunks]\nqueue = "cpu"')
    path = tmp_path / "policies.toml"
    path.write_text(text)
    policies.load(path, worker.activity_names())
    with pytest.raises(worker.RoleError, match=r"index_chunks.*embedded store belongs to the vector role"):
        worker.check_role(Settings(data_dir=tmp_path), "cpu")
    worker.check_role(Settings(data_dir=tmp_path, qdrant_url="http://qdrant:6333"), "cpu")  # a server: fine
    env = {**os.environ, "RAGLINE_DATA_DIR": str(tmp_path), "RAGLINE_POLICIES": str(path),
           "RAGLINE_TEMPORAL_ADDRESS": "127.0.0.1:1"}
    proc = subprocess.run([sys.executable, "worker.py", "--role", "cpu"], cwd=PROJECT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "embedded store belongs to the vector role" in proc.stdout + proc.stderr
    assert not (tmp_path / "qdrant").exists(), "a cpu worker opened the embedded store"


def test_a_worker_on_a_keys_file_that_does_not_read_stops_at_start_with_the_reason(tmp_path):
    """Its tenants' limits would not read when a job asks for its running slot: retried for ever, every job
    on that worker would stay queued. It does not start, and says which line is wrong."""
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text("[tenants.acme]\nmax_running_job = 2\n")
    env = {**os.environ, "RAGLINE_DATA_DIR": str(tmp_path), "RAGLINE_API_KEYS_FILE": str(keys_file),
           "RAGLINE_TEMPORAL_ADDRESS": "127.0.0.1:1", "RAGLINE_WORKER_METRICS_PORT": "0"}
    proc = subprocess.run([sys.executable, "worker.py", "--role", "workflows"], cwd=PROJECT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert "max_running_job" in proc.stdout + proc.stderr


async def test_role_workers_poll_their_own_queues_with_their_own_slots(temporal_env, tmp_path, restore_policies):
    address = temporal_env.client.service_client.config.target_host
    settings = Settings(data_dir=tmp_path, temporal_address=address, task_queue="roles", policies=FAST,
                        embeddings_base_url="http://127.0.0.1:1/v1", llm_base_url="http://127.0.0.1:1/v1",
                        llm_concurrency=3, worker_cpu_concurrency=2, worker_vector_concurrency=5,
                        worker_max_pollers=4)
    index = open_index(settings)
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as executor:
            built = {}
            for role in queues.ROLES:  # a client of its own each, as each role is its own process
                client = await connect(settings)
                built[role] = worker.build_worker(
                    client, settings, index if "vector" in queues.ROLES[role] else None, executor, role)
            configs = {role: [w.config() for w in rw.workers] for role, rw in built.items()}
    finally:
        index.close()
    assert {role: [c["task_queue"] for c in cs] for role, cs in configs.items()} == {
        "all": ["roles", "roles-cpu", "roles-llm", "roles-vector"], "workflows": ["roles"],
        "cpu": ["roles-cpu"], "llm": ["roles-llm"], "vector": ["roles-vector"]}

    def names(config) -> set[str]:
        return {policies.activity_name(a) for a in config["activities"]}

    [llm] = configs["llm"]
    assert llm["max_concurrent_activities"] == 3 and names(llm) == worker.served_activities("llm")
    [cpu] = configs["cpu"]
    assert cpu["max_concurrent_activities"] == 2 and not cpu["workflows"]
    [vector] = configs["vector"]
    assert vector["max_concurrent_activities"] == 5
    assert [w.__name__ for w in vector["workflows"]] == ["SearchWorkflow"]
    [main] = configs["workflows"]
    assert "SearchWorkflow" not in {w.__name__ for w in main["workflows"]} and len(main["workflows"]) == 9
    assert main["activity_task_poller_behavior"].maximum == 4
    # The server's statistics (backlog, reviews and dead letters waiting) are read by the roles running
    # the jobs' workflows only: a fleet of activity workers would ask the same over and over.
    assert [role for role in queues.ROLES if ServerStatsPoller.wanted(role)] == ["all", "workflows"]


async def test_an_activity_role_exports_the_step_slas_its_latency_alert_compares_with(temporal_env, tmp_path):
    """The steps run on activity roles; their SLA gauge was set by the server-statistics poller only, which
    runs on the workflow roles, so RaglineStepLatencyOverSLA had no SLA to compare an llm worker's p95 with."""
    port = free_port()
    env = {**os.environ, "RAGLINE_DATA_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1",
           "RAGLINE_TEMPORAL_ADDRESS": temporal_env.client.service_client.config.target_host,
           "RAGLINE_TASK_QUEUE": "sla-role", "RAGLINE_POLICIES": str(FAST),
           "RAGLINE_LLM_BASE_URL": "http://127.0.0.1:1/v1", "RAGLINE_WORKER_METRICS_PORT": str(port),
           "RAGLINE_STEP_SLA": '{"generate_answer": 90}'}
    proc = subprocess.Popen([sys.executable, "worker.py", "--role", "llm"], cwd=PROJECT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = re.compile(r'^ragline_step_sla_seconds\{.*activity_type="(\w+)".*\} (\S+)$', re.M)
    try:
        async with httpx.AsyncClient(timeout=5) as http:
            async def slas() -> dict[str, float] | None:
                assert proc.poll() is None, proc.communicate()[0]
                try:
                    text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
                except httpx.TransportError:  # not serving yet
                    return None
                return {step: float(value) for step, value in line.findall(text)} or None

            found = await eventually(slas, timeout=60, every=0.5, what="ragline_step_sla_seconds from the llm role")
        assert found["generate_answer"] == 90.0
        assert found["agent_plan"] == metrics.DEFAULT_STEP_SLA_SECONDS["agent_plan"]
        # Only its own steps: the alert takes the largest SLA any worker exports, and another role's default
        # for generate_answer would outvote the override set here.
        assert "extract_text" not in found and "retrieve_context" not in found, found
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_the_llm_queue_of_a_local_model_hears_a_cancel_within_its_quick_beat(tmp_path, restore_policies):
    """One model call at a time: the worker sends a model call's heartbeats (and so hears a side step's stop) every
    [heartbeats] few_model_slots; a hosted endpoint's 64 slots keep [heartbeats] every."""
    policies.load(policies.DEFAULT_FILE, worker.activity_names())
    local = worker._slots(Settings(data_dir=tmp_path, llm_concurrency=1), "llm")
    hosted = worker._slots(Settings(data_dir=tmp_path, llm_concurrency=64), "llm")
    assert (local["max_concurrent_activities"], local["max_heartbeat_throttle_interval"]) == (1, timedelta(seconds=0.5))
    assert hosted["max_heartbeat_throttle_interval"] == hosted["default_heartbeat_throttle_interval"] == \
        timedelta(seconds=2)


def test_resource_based_slots_for_the_cpu_role(tmp_path):
    slots = worker._slots(Settings(data_dir=tmp_path, worker_resource_tuning=True, worker_cpu_concurrency=6), "cpu")
    assert set(slots) == {"tuner"}
    assert worker._slots(Settings(data_dir=tmp_path), "cpu") == {"max_concurrent_activities": 4}


@pytest.fixture
def restore_workflow_definitions():
    """Applying versioning behaviours changes the workflow classes of this process; the session's
    unversioned in-process worker must get them back as they were (the server refuses a behaviour
    from an unversioned worker)."""
    saved = {cls: getattr(cls, "__temporal_workflow_definition") for cls in worker.WORKFLOWS}
    yield
    for cls, defn in saved.items():
        setattr(cls, "__temporal_workflow_definition", defn)
        setattr(defn.run_fn, "__temporal_workflow_definition", defn)


def test_worker_versioning_is_declared_by_a_build_id(tmp_path, restore_workflow_definitions):
    assert worker.deployment_config(Settings(data_dir=tmp_path)) is None
    config = worker.deployment_config(Settings(data_dir=tmp_path, worker_build_id="2024-06-01.3"))
    assert config.use_worker_versioning
    assert (config.version.deployment_name, config.version.build_id) == ("ragline", "2024-06-01.3")
    from temporalio.common import VersioningBehavior

    from workflows.agent import AgentWorkflow
    from workflows.chat import ChatSessionWorkflow, ChatTurnWorkflow
    from workflows.ingest import IngestWorkflow

    def behavior(cls):
        return getattr(cls, "__temporal_workflow_definition").versioning_behavior

    assert behavior(ChatSessionWorkflow) == behavior(AgentWorkflow) == behavior(ChatTurnWorkflow) \
        == VersioningBehavior.AUTO_UPGRADE
    assert behavior(IngestWorkflow) == VersioningBehavior.PINNED
    assert set(worker.VERSIONING_BEHAVIORS) == set(worker.WORKFLOWS)


# -- a cluster: Temporal with TLS / an API key, a Qdrant server ------------------------------------------

def test_temporal_client_options_for_the_dev_server_mtls_and_an_api_key(tmp_path):
    assert connect_options(Settings(data_dir=tmp_path)) == {"namespace": "default", "tls": False}
    for name in ("ca.pem", "client.pem", "client.key"):
        (tmp_path / name).write_bytes(f"-----{name}-----".encode())
    mtls = connect_options(Settings(
        data_dir=tmp_path, temporal_namespace="ragline-prod", temporal_tls_ca=tmp_path / "ca.pem",
        temporal_tls_cert=tmp_path / "client.pem", temporal_tls_key=tmp_path / "client.key",
        temporal_tls_server_name="temporal.internal"))
    assert mtls["namespace"] == "ragline-prod" and "api_key" not in mtls
    tls = mtls["tls"]
    assert isinstance(tls, TLSConfig)
    assert (tls.server_root_ca_cert, tls.client_cert, tls.client_private_key, tls.domain) == (
        b"-----ca.pem-----", b"-----client.pem-----", b"-----client.key-----", "temporal.internal")
    cloud = connect_options(Settings(data_dir=tmp_path, temporal_namespace="ragline.a2b3c",
                                     temporal_api_key="key-123"))
    assert cloud == {"namespace": "ragline.a2b3c", "tls": True, "api_key": "key-123"}
    with pytest.raises(ValueError, match="go together"):
        connect_options(Settings(data_dir=tmp_path, temporal_tls_cert=tmp_path / "client.pem"))
    with pytest.raises(ValueError, match="go together"):  # not plain gRPC with the key ignored
        connect_options(Settings(data_dir=tmp_path, temporal_tls_key=tmp_path / "client.key"))


async def test_a_lazy_client_for_temporal_cloud_is_built_without_a_network(tmp_path):
    settings = Settings(data_dir=tmp_path, temporal_address="ragline.a2b3c.tmprl.cloud:7233",
                        temporal_namespace="ragline.a2b3c", temporal_api_key="key-123")
    client = await connect(settings, lazy=True)
    assert client.namespace == "ragline.a2b3c"
    config = client.service_client.config
    assert config.target_host == "ragline.a2b3c.tmprl.cloud:7233" and config.api_key == "key-123"
    assert config.tls is True


def test_qdrant_server_client_is_built_without_a_network(tmp_path):
    settings = Settings(data_dir=tmp_path, qdrant_url="https://qdrant.ragline.svc:6333", qdrant_api_key="q-key")
    index = open_index(settings)
    remote = index.client._client
    assert not index.embedded
    assert (remote.rest_uri, remote._api_key) == ("https://qdrant.ragline.svc:6333", "q-key")
    assert not (tmp_path / "qdrant").exists()
    index.close()


async def test_the_statistics_poll_reports_searches_waiting_on_the_vector_queue(temporal_env, tmp_path):
    """Searches run as workflows on the vector queue: with no vector worker they wait there as workflow tasks,
    which the unpolled-queue alert must see. Only the main queue's workflow tasks were counted, so a search
    waiting for a vector worker that never came showed a backlog of 0."""
    port = free_port()
    settings = Settings(data_dir=tmp_path, task_queue="stats-vector",
                        temporal_address=temporal_env.client.service_client.config.target_host)
    runtime = worker_runtime(f"127.0.0.1:{port}")
    client = await connect(settings, runtime=runtime)
    vector = queues.queue_name(settings.task_queue, "vector")
    await client.start_workflow("SearchWorkflow", id=f"stats-search-{uuid.uuid4().hex}", task_queue=vector,
                                execution_timeout=timedelta(minutes=5))
    poller = ServerStatsPoller(client, settings, runtime)
    labels = (f'task_queue="{vector}"', 'type="workflow"')
    async with httpx.AsyncClient(timeout=5) as http:
        async def waiting() -> float | None:
            await poller.poll_once()
            text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
            found = [float(row.rsplit(" ", 1)[1]) for row in text.splitlines()
                     if row.startswith("ragline_task_queue_backlog{") and all(x in row for x in labels)]
            return found[0] if found and found[0] >= 1 else None
        assert await eventually(waiting, timeout=60, every=1, what=f"a workflow backlog on {vector}") == 1
