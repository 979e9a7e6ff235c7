"""The Ragline worker. `python worker.py` runs every workflow and activity in one process (role
`all`); `python worker.py --role ROLE` runs one role (temporal/queues.py: workflows, cpu, llm, vector),
so that each role is sized and scaled on its own. The policy file decides which activity runs on
which queue; a role polls only its own queues and registers only the activities routed there."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import inspect
import os
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import structlog
from temporalio.client import Client
from temporalio.service import RPCError
from temporalio.common import VersioningBehavior, WorkerDeploymentVersion
from temporalio.worker import (
    PollerBehaviorAutoscaling, ResourceBasedSlotConfig, Worker, WorkerDeploymentConfig, WorkerTuner,
)
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from activities.agent import AgentActivities
from activities.blobs import BlobActivities
from activities.chat import ChatActivities
from activities.evaluation import EvaluationActivities
from activities.gate import GateActivities
from activities.ingest import IngestActivities
from activities.jobs import JobActivities
from activities.search import SearchActivities
from ragline import logs, relevance, tracing
from ragline.answer_cache import AnswerCache
from ragline.blobstore import BlobStore
from ragline.embeddings import Embedder, build_embedder
from ragline.errors import StoreUnavailableError
from ragline.keys import KeyRing, KeysFileError
from ragline.llm import ChatModel
from ragline.settings import Settings, get_settings
from ragline.vectorstore import VectorIndex, open_index
from temporal import policies, queues
from temporal.client import connect
from temporal.deployment import make_first_build_current
from temporal.telemetry import (
    ServerStatsPoller, StepTelemetry, export_activity_slots, export_step_sla, worker_runtime,
)
from temporal.schedules import ensure_blob_sweep
from temporal.search_attributes import ensure_registered
from workflows.agent import AgentWorkflow
from workflows.blob_sweep import BlobSweepWorkflow
from workflows.chat import ChatSessionWorkflow, ChatTurnWorkflow
from workflows.evaluation import EvaluationWorkflow
from workflows.gate import TenantGateWorkflow
from workflows.ingest import IngestDocumentWorkflow, IngestWorkflow
from workflows.remove import RemoveDocumentWorkflow
from workflows.search import SearchWorkflow

log = structlog.get_logger("ragline.worker")

# Workflows per queue kind: every job on main; SearchWorkflow on vector, next to the store, so that a
# search stays one local activity in the process that holds the store.
QUEUE_WORKFLOWS: dict[str, list[type]] = {
    "main": [IngestWorkflow, IngestDocumentWorkflow, RemoveDocumentWorkflow, ChatSessionWorkflow, ChatTurnWorkflow,
             AgentWorkflow, EvaluationWorkflow, TenantGateWorkflow, BlobSweepWorkflow],
    "vector": [SearchWorkflow],
}
WORKFLOWS = [w for ws in QUEUE_WORKFLOWS.values() for w in ws]
ACTIVITY_CLASSES = (IngestActivities, SearchActivities, JobActivities, ChatActivities, AgentActivities,
                    EvaluationActivities, GateActivities, BlobActivities)

# What each activity needs besides the blob store and the Temporal client. A role builds only what the
# activities routed to its queues need: the llm role loads no embedding model, and only a role that
# runs store activities opens the vector store.
_NAME = policies.activity_name
NEEDS: dict[str, frozenset[str]] = {
    # The answer cache lives with the index (it is keyed by the collection's version): cache_answer too.
    "index": frozenset(map(_NAME, (
        IngestActivities.index_chunks, IngestActivities.prune_stale_chunks, IngestActivities.remove_document_chunks,
        ChatActivities.retrieve_context,
        ChatActivities.cache_answer, AgentActivities.search_documents, SearchActivities.search_chunks,
        EvaluationActivities.evaluate_collection))),
    "embedder": frozenset(map(_NAME, (
        IngestActivities.embed_chunks, ChatActivities.retrieve_context, AgentActivities.search_documents,
        SearchActivities.search_chunks, EvaluationActivities.evaluate_collection))),
    # The chat model's endpoint and its key (an evaluation that answers its golden questions calls it too).
    "model": frozenset(map(_NAME, (
        ChatActivities.generate_answer, ChatActivities.generate_answer_fallback, ChatActivities.summarize_context,
        ChatActivities.extract_entities, AgentActivities.agent_plan, EvaluationActivities.evaluate_collection))),
}
SEARCH = _NAME(SearchActivities.search_chunks)


# The sandbox still refuses non-deterministic calls (clock, random, I/O) in workflow code, but imports
# no module again for each workflow run: the workflow modules keep no state of their own, and a new
# sandbox per run cost every job's first workflow task several milliseconds and the worker about a
# tenth of its CPU (BENCHMARKS.md).
WORKFLOW_RUNNER = SandboxedWorkflowRunner(restrictions=SandboxRestrictions.default.with_passthrough_all_modules())


class RoleError(ValueError):
    """The policy file and the role disagree (e.g. a store activity outside the vector queue while
    the store is embedded)."""


def _activity_methods(cls: type) -> list[str]:
    return [name for name, fn in vars(cls).items() if hasattr(fn, "__temporal_activity_definition")]


def activities_of(instance: object) -> list[Callable[..., Any]]:
    """An activity class's activities, bound to the instance that holds what they need."""
    return [getattr(instance, name) for name in _activity_methods(type(instance))]


def activity_names() -> list[str]:
    """Every activity the worker registers, by name: the policy file must cover these and no others."""
    return [policies.activity_name(getattr(cls, name)) for cls in ACTIVITY_CLASSES for name in _activity_methods(cls)]


def served_activities(role: str) -> set[str]:
    """Names of the activities the role runs: those the (loaded) policy file puts on its queues."""
    kinds = queues.ROLES[role]
    return {name for name in activity_names() if policies.policy(name).queue in kinds}


def role_needs(role: str) -> set[str]:
    served = served_activities(role)
    return {what for what, names in NEEDS.items() if served & names}


def check_role(settings: Settings, role: str) -> None:
    """Raise RoleError if this role cannot run what the policy file routes to it."""
    if policies.policy(SEARCH).queue != "vector":
        raise RoleError(f"{SEARCH} runs as a local activity of SearchWorkflow on the vector queue: "
                        'its policy must say queue = "vector"')
    if settings.qdrant_url or "vector" in queues.ROLES[role]:
        return
    stray = sorted(served_activities(role) & NEEDS["index"])
    if stray:
        raise RoleError(
            f"role {role!r} would run {', '.join(stray)}, which open(s) the vector store, but the embedded "
            'store belongs to the vector role: put them on queue = "vector" in the policy file, or set '
            "RAGLINE_QDRANT_URL to a Qdrant server")


class _Unavailable:
    """Stands in for a component a role does not build; using it is a wiring bug, said plainly."""

    def __init__(self, what: str, role: str) -> None:
        self._what, self._role = what, role

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"the {self._what} is not available in a worker of role {self._role!r}; "
                           "check the queue of this activity in the policy file")


class RaglineWorker:
    """One SDK worker per task queue of the role (temporal/queues.py), run together, each with its
    own slot count: main (workflows and I/O-bound activities), cpu, llm and vector."""

    def __init__(self, workers: list[Worker], role: str = "all", activity_slots: dict[str, int] | None = None,
                 models: list[ChatModel] | None = None) -> None:
        self.workers = workers
        self.role = role
        self._models = models or []  # their HTTP connections close once the workers have stopped
        # The most activities it runs at once per task queue (the capacity the alerts compare backlogs with).
        self.activity_slots = activity_slots or {}

    @property
    def task_queues(self) -> list[str]:
        return [w.task_queue for w in self.workers]

    async def run(self) -> None:
        await asyncio.gather(*(w.run() for w in self.workers))

    async def shutdown(self) -> None:
        await asyncio.gather(*(w.shutdown() for w in self.workers))
        await self._close_models()

    async def _close_models(self) -> None:
        models, self._models = self._models, []
        for model in models:
            await model.close()

    @property
    def is_running(self) -> bool:
        return all(w.is_running for w in self.workers)

    async def __aenter__(self) -> "RaglineWorker":
        for w in self.workers:
            await w.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        for w in reversed(self.workers):
            await w.__aexit__(*exc)
        await self._close_models()


async def keep_alive(path: Path, every: float, worker: RaglineWorker) -> None:
    """Touch `path` every `every` seconds while the worker runs. A liveness probe that finds it older than a few
    periods restarts a worker whose event loop hangs (a sync call in an async step, say) or whose SDK workers
    ended: its pollers would be up, or its process would be, and no task of its queues would run."""
    while True:
        if worker.is_running:
            try:
                path.touch()
            except OSError as exc:
                log.warning("cannot touch the worker's alive file", path=str(path), error=str(exc))
        await asyncio.sleep(every)


def fallback_model(settings: Settings) -> ChatModel | None:
    """The lighter model a turn falls back to (RAGLINE_FALLBACK_LLM_*), or None when none is configured."""
    if not settings.fallback_llm_base_url:
        return None
    # RAGLINE_LLM_LOCAL speaks of the main model: whether the fallback is local is judged from its own URL
    # (a hosted fallback of a local model would otherwise get unmasked text).
    return ChatModel(settings.model_copy(update={
        "llm_base_url": settings.fallback_llm_base_url, "llm_model": settings.fallback_llm_model or settings.llm_model,
        "llm_api_key": settings.fallback_llm_api_key, "llm_local": None}))


# Versioning behaviour of each workflow, chosen on purpose (applied only with worker versioning on: the
# server rejects a behaviour from an unversioned worker). Jobs that finish in minutes stay PINNED to the
# build that started them, and the old build drains. The long-lived ones move to the new build
# (AUTO_UPGRADE): a chat session lives for days (continue-as-new every 100 turns), a turn queues behind
# its session's earlier turns and may wait 24 h for a review, an agent may wait 24 h for a review.
# Pinning them would keep every old build running for as long as its longest session; instead their
# code changes must replay old histories (tests/test_replay.py, `workflow.patched` where needed).
VERSIONING_BEHAVIORS: dict[type, VersioningBehavior] = {
    IngestWorkflow: VersioningBehavior.PINNED,
    IngestDocumentWorkflow: VersioningBehavior.PINNED,
    RemoveDocumentWorkflow: VersioningBehavior.PINNED,
    SearchWorkflow: VersioningBehavior.PINNED,
    ChatSessionWorkflow: VersioningBehavior.AUTO_UPGRADE,
    ChatTurnWorkflow: VersioningBehavior.AUTO_UPGRADE,
    AgentWorkflow: VersioningBehavior.AUTO_UPGRADE,
    EvaluationWorkflow: VersioningBehavior.PINNED,
    TenantGateWorkflow: VersioningBehavior.AUTO_UPGRADE,  # lives on (continue-as-new), like a session
    BlobSweepWorkflow: VersioningBehavior.PINNED,
}


def _apply_versioning_behaviors() -> None:
    for cls, behavior in VERSIONING_BEHAVIORS.items():
        defn = getattr(cls, "__temporal_workflow_definition")
        if defn.versioning_behavior != behavior:
            defn = dataclasses.replace(defn, versioning_behavior=behavior)
            setattr(cls, "__temporal_workflow_definition", defn)
            setattr(defn.run_fn, "__temporal_workflow_definition", defn)


def deployment_config(settings: Settings) -> WorkerDeploymentConfig | None:
    """Worker versioning, when a build id is set: every role of one build is one deployment version,
    and each workflow gets its behaviour from VERSIONING_BEHAVIORS."""
    if not settings.worker_build_id:
        return None
    _apply_versioning_behaviors()
    return WorkerDeploymentConfig(
        version=WorkerDeploymentVersion(deployment_name=settings.worker_deployment_name,
                                        build_id=settings.worker_build_id),
        use_worker_versioning=True, default_versioning_behavior=VersioningBehavior.PINNED)


def activity_slot_limit(settings: Settings, kind: str) -> int:
    """The most activities one worker runs at once on the queue of `kind` (a resource-based tuner's maximum)."""
    return {"main": settings.worker_io_concurrency, "cpu": settings.worker_cpu_concurrency,
            "llm": settings.effective_llm_concurrency}.get(kind, settings.worker_vector_concurrency)


def _slots(settings: Settings, kind: str) -> dict[str, Any]:
    """The slot options of the worker on one queue kind, from settings."""
    most = activity_slot_limit(settings, kind)
    if kind == "main":
        return {"max_concurrent_activities": most,
                "max_concurrent_workflow_tasks": settings.worker_workflow_concurrency}
    if kind == "cpu" and settings.worker_resource_tuning:
        return {"tuner": WorkerTuner.create_resource_based(
            target_memory_usage=settings.worker_target_memory, target_cpu_usage=settings.worker_target_cpu,
            activity_config=ResourceBasedSlotConfig(minimum_slots=1, maximum_slots=most,
                                                    ramp_throttle=timedelta(milliseconds=500)))}
    if kind == "llm":
        # Model calls in flight are bounded here, per model endpoint, not by a semaphore in an activity. On few
        # slots their beats (and so a cancel's answer) come sooner: a side step steps aside for a later answer.
        beat = policies.model_call_beat(most)
        return {"max_concurrent_activities": most,
                "max_task_queue_activities_per_second": settings.llm_requests_per_second,
                "max_heartbeat_throttle_interval": beat, "default_heartbeat_throttle_interval": beat}
    if kind == "vector":
        return {"max_concurrent_activities": most, "max_concurrent_local_activities": most}
    return {"max_concurrent_activities": most}


def _pollers(settings: Settings) -> dict[str, Any]:
    if settings.worker_max_pollers <= 0:
        return {}
    top = settings.worker_max_pollers
    behavior = PollerBehaviorAutoscaling(minimum=1, maximum=top, initial=min(5, top))
    return {"workflow_task_poller_behavior": behavior, "activity_task_poller_behavior": behavior}


def activity_threads(settings: Settings) -> int:
    """Threads for the sync activities: CPU-bound ones and the vector store's."""
    return settings.worker_cpu_concurrency + settings.worker_vector_concurrency + 4


def _prepare_relevance(embedder: Embedder, executor: concurrent.futures.ThreadPoolExecutor, *, remote: bool) -> None:
    """The relevance gate's everyday questions are embedded in the background at start, so no question
    waits for them (in-process only: a remote endpoint that hangs would hold the worker's stop for its
    timeout); a gate fitted for another embedding model is said once, here."""
    if not relevance.fitted_for(embedder):
        log.warning("the relevance gate was fitted for another embedding model: its hubness feature is off, and "
                    "its threshold may refuse more than it should (README: Grounded answers)",
                    embeddings_model=embedder.name, fitted_for=relevance.FITTED_MODEL)
        return

    def warmed(future: concurrent.futures.Future) -> None:
        if (exc := future.exception()) is not None:  # the first questions embed them instead
            log.warning("could not embed the relevance gate's everyday questions at start", error=repr(exc))

    if not remote:
        executor.submit(relevance.warm, embedder).add_done_callback(warmed)


def build_worker(client: Client, settings: Settings, index: VectorIndex | None,
                 executor: concurrent.futures.ThreadPoolExecutor, role: str = "all") -> RaglineWorker:
    """One place that wires workflows and activities for a role; used by `main()` and by the tests.
    `index` may be None for a role that runs no store activity."""
    if role not in queues.ROLES:
        raise RoleError(f"unknown role {role!r} (roles: {', '.join(queues.ROLES)})")
    policies.load(settings.policies, activity_names(), dead_letter_ttl=settings.dead_letter_ttl)
    check_role(settings, role)
    needs = role_needs(role)
    if "index" in needs and index is None:
        raise RoleError(f"role {role!r} runs activities that need the vector store, and none was given")
    blobs = BlobStore(settings.blob_dir)
    embedder = build_embedder(settings) if "embedder" in needs else _Unavailable("embedding model", role)
    if "embedder" in needs:
        _prepare_relevance(embedder, executor, remote=bool(settings.embeddings_base_url))
    store = index if index is not None else _Unavailable("vector store", role)
    model, fallback = ChatModel(settings), fallback_model(settings)
    activities = [
        *activities_of(IngestActivities(settings, blobs, embedder, store)),
        *activities_of(SearchActivities(embedder, store)),
        *activities_of(JobActivities(client)),
        *activities_of(GateActivities(client, settings)),
        *activities_of(ChatActivities(settings, blobs, embedder, store, model,
                                      cache=AnswerCache(settings.answer_cache_size), fallback=fallback)),
        *activities_of(AgentActivities(embedder, store, model)),
        *activities_of(EvaluationActivities(settings, blobs, embedder, store, model)),
        *activities_of(BlobActivities(client, blobs)),
    ]
    common: dict[str, Any] = {**_pollers(settings),
                              "graceful_shutdown_timeout": timedelta(seconds=settings.worker_graceful_shutdown),
                              # A cancel reaches a running activity with a heartbeat's answer: soon.
                              "max_heartbeat_throttle_interval": policies.heartbeat_every(),
                              "default_heartbeat_throttle_interval": policies.heartbeat_every(),
                              # step latency/attempts, log context; tracing comes from the client
                              "interceptors": [StepTelemetry()],
                              "workflow_runner": WORKFLOW_RUNNER}
    if (deployment := deployment_config(settings)) is not None:
        common["deployment_config"] = deployment
    workers = []
    activity_slots = {}
    for kind in queues.ROLES[role]:
        mine = [a for a in activities if policies.policy(policies.activity_name(a)).queue == kind]
        flows = QUEUE_WORKFLOWS.get(kind, [])
        if not mine and not flows:
            log.info("nothing routed to this queue: not polling it", queue_kind=kind)
            continue
        # Threads only where an activity is sync (extraction, embedding, the vector store): a queue of
        # async activities runs them on the loop, and needs no thread per slot.
        threads = {"activity_executor": executor} if any(not inspect.iscoroutinefunction(a) for a in mine) else {}
        name = queues.queue_name(settings.task_queue, kind)
        workers.append(Worker(client, task_queue=name, workflows=flows, activities=mine,
                              **{**common, **threads, **_slots(settings, kind)}))
        if mine:
            activity_slots[name] = activity_slot_limit(settings, kind)
    return RaglineWorker(workers, role, activity_slots, models=[m for m in (model, fallback) if m is not None])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=list(queues.ROLES), default="all",
                        help="what this process runs (default: all, in one process)")
    return parser.parse_args(argv)


async def main(argv: list[str] | None = None) -> int:
    role = parse_args(argv).role
    settings = get_settings()
    logs.configure(settings.log_level, settings.log_json, redact=settings.redact_pii)
    try:
        policies.load(settings.policies, activity_names(), dead_letter_ttl=settings.dead_letter_ttl)
        check_role(settings, role)
    except (policies.PolicyError, RoleError) as exc:
        log.error("invalid policy file for this role", role=role, error=str(exc))
        return 2
    # The tenants' limits, for a role that hands out running slots: a file that does not read would hold every
    # job's slot, retried for ever. (Other roles never read it: a bad edit must not stop them scaling.)
    if policies.policy(policies.activity_name(GateActivities.acquire_slot)).queue in queues.ROLES[role]:
        try:
            KeyRing(settings.effective_api_keys_file).read()
        except (KeysFileError, OSError) as exc:
            log.error("the keys file does not read", error=str(exc))
            return 5
    index = None
    if "index" in role_needs(role):
        try:
            index = open_index(settings)
        except StoreUnavailableError as exc:
            log.error("cannot open the vector store", error=exc.message)
            return 3
    tracing.configure("ragline-worker")
    address = f"{settings.worker_metrics_host}:{settings.worker_metrics_port}" if settings.worker_metrics_port else None
    try:
        runtime = worker_runtime(address, settings.step_sla)
    except ValueError as exc:
        log.error("cannot serve worker metrics (RAGLINE_WORKER_METRICS_PORT)", address=address, error=str(exc))
        return 4
    if address:
        log.info("worker metrics", url=f"http://{address}/metrics")
        export_step_sla(runtime, settings, [name for name, policy in policies.loaded().activities.items()
                                            if policy.queue in queues.ROLES[role]])
    client = await connect(settings, identity=f"ragline-{role}@{socket.gethostname()}:{os.getpid()}",
                           runtime=runtime)
    if role in ("all", "workflows"):
        await ensure_registered(client, settings.temporal_namespace)
        try:
            await ensure_blob_sweep(client, settings)
        except RPCError as exc:  # e.g. a namespace where this key may not manage schedules: jobs still run
            log.warning("cannot keep the blob sweep's schedule: run `python -m ragline.blob_sweep` instead",
                        error=str(exc))
    reads_stats = address and ServerStatsPoller.wanted(role)
    poller = asyncio.create_task(ServerStatsPoller(client, settings, runtime).run()) if reads_stats else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    with concurrent.futures.ThreadPoolExecutor(max_workers=activity_threads(settings)) as executor:
        worker = build_worker(client, settings, index, executor, role)
        if address:
            export_activity_slots(runtime, worker.activity_slots)
        log.info("worker polling", role=role, task_queues=worker.task_queues, temporal=settings.temporal_address,
                 vector_store=(settings.qdrant_url or str(settings.qdrant_path)) if index else None,
                 build_id=settings.worker_build_id)
        async with worker:
            # Its pollers make the version known first: a first deploy's build is made current, else no job runs.
            current = asyncio.create_task(make_first_build_current(
                client, settings.worker_deployment_name, settings.worker_build_id)) \
                if settings.worker_build_id and role in ("all", "workflows") else None
            alive = asyncio.create_task(keep_alive(settings.worker_alive_file, settings.worker_alive_every, worker)) \
                if settings.worker_alive_file else None
            await stop.wait()
            log.info("worker stopping", role=role)
            for task in (current, alive):
                if task:
                    task.cancel()
    if poller:
        poller.cancel()
    if index is not None:
        index.close()
    return 0


if __name__ == "__main__":
    code = 1
    try:
        code = asyncio.run(main())
    except BaseException:  # noqa: BLE001 - said here: os._exit below leaves before Python would print it
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except OSError:  # its reader has gone (a supervisor killed outright): nothing left to tell
                pass
        # Leave without interpreter teardown: the SDK can crash or hang at exit (temporalio/sdk-python#300).
        # A flush that raised once skipped this, and the worker hung on, orphaned, after `make run` died.
        os._exit(code)
