"""The Ragline worker: runs every workflow and activity. Start it with `python worker.py`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import sys

import structlog
from temporalio.client import Client
from temporalio.worker import Worker

from activities.agent import AgentActivities
from activities.chat import ChatActivities
from activities.evaluation import EvaluationActivities
from activities.ingest import IngestActivities
from activities.jobs import JobActivities
from activities.search import SearchActivities
from ragline import logs
from ragline.answer_cache import AnswerCache
from ragline.blobstore import BlobStore
from ragline.embeddings import build_embedder
from ragline.errors import StoreUnavailableError
from ragline.llm import ChatModel
from ragline.settings import Settings, get_settings
from ragline.vectorstore import VectorIndex, open_index
from temporal import policies, queues
from temporal.client import connect
from temporal.search_attributes import ensure_registered
from workflows.agent import AgentWorkflow
from workflows.chat import ChatSessionWorkflow, ChatTurnWorkflow
from workflows.evaluation import EvaluationWorkflow
from workflows.ingest import IngestDocumentWorkflow, IngestWorkflow
from workflows.search import SearchWorkflow

log = structlog.get_logger("ragline.worker")

WORKFLOWS = [IngestWorkflow, IngestDocumentWorkflow, SearchWorkflow, ChatSessionWorkflow, ChatTurnWorkflow,
             AgentWorkflow, EvaluationWorkflow]
ACTIVITY_CLASSES = (IngestActivities, SearchActivities, JobActivities, ChatActivities, AgentActivities,
                    EvaluationActivities)


def activity_names() -> list[str]:
    """Every activity the worker registers, by name: the policy file must cover these and no others."""
    return [policies.activity_name(fn) for cls in ACTIVITY_CLASSES for fn in vars(cls).values()
            if hasattr(fn, "__temporal_activity_definition")]


class RaglineWorker:
    """One worker per task queue (temporal/queues.py), run together: main (workflows and I/O-bound
    activities), cpu and llm, each with its own slot count.

    Every activity is registered on each, so the policy file alone decides where each one runs.
    """

    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers

    async def run(self) -> None:
        await asyncio.gather(*(w.run() for w in self.workers))

    async def shutdown(self) -> None:
        await asyncio.gather(*(w.shutdown() for w in self.workers))

    async def __aenter__(self) -> "RaglineWorker":
        for w in self.workers:
            await w.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        for w in reversed(self.workers):
            await w.__aexit__(*exc)


def fallback_model(settings: Settings) -> ChatModel | None:
    """The lighter model a turn falls back to (RAGLINE_FALLBACK_LLM_*), or None when none is configured."""
    if not settings.fallback_llm_base_url:
        return None
    return ChatModel(settings.model_copy(update={
        "llm_base_url": settings.fallback_llm_base_url, "llm_model": settings.fallback_llm_model or settings.llm_model,
        "llm_api_key": settings.fallback_llm_api_key}))


def build_worker(client: Client, settings: Settings, index: VectorIndex,
                 executor: concurrent.futures.ThreadPoolExecutor) -> RaglineWorker:
    """One place that wires workflows and activities; used by `main()` and by the tests."""
    blobs = BlobStore(settings.blob_dir)
    embedder = build_embedder(settings)
    model = ChatModel(settings)
    activities = [
        *IngestActivities(settings, blobs, embedder, index).all(),
        *SearchActivities(embedder, index).all(),
        *JobActivities(client).all(),
        *ChatActivities(settings, blobs, embedder, index, model, cache=AnswerCache(settings.answer_cache_size),
                        fallback=fallback_model(settings)).all(),
        *AgentActivities(embedder, index, model).all(),
        *EvaluationActivities(settings, blobs, embedder, index, model).all(),
    ]
    policies.load(settings.policies, [policies.activity_name(a) for a in activities],
                  dead_letter_ttl=settings.dead_letter_ttl)
    queue = settings.task_queue
    return RaglineWorker([
        Worker(client, task_queue=queue, workflows=WORKFLOWS, activities=activities,
               activity_executor=executor, max_concurrent_activities=settings.worker_io_concurrency),
        Worker(client, task_queue=queues.queue_name(queue, "cpu"), activities=activities,
               activity_executor=executor, max_concurrent_activities=settings.worker_cpu_concurrency),
        # Model calls in flight are bounded here, per model endpoint, not by a semaphore in an activity.
        Worker(client, task_queue=queues.queue_name(queue, "llm"), activities=activities,
               activity_executor=executor, max_concurrent_activities=settings.effective_llm_concurrency,
               max_task_queue_activities_per_second=settings.llm_requests_per_second),
    ])


async def main() -> int:
    settings = get_settings()
    logs.configure(settings.log_level, settings.log_json)
    try:
        policies.load(settings.policies, activity_names(), dead_letter_ttl=settings.dead_letter_ttl)
    except policies.PolicyError as exc:
        log.error("invalid policy file", error=str(exc))
        return 2
    try:
        index = open_index(settings)
    except StoreUnavailableError as exc:
        log.error("cannot open the vector store", error=exc.message)
        return 3
    client = await connect(settings, identity=f"ragline-worker@{os.getpid()}")
    await ensure_registered(client, settings.temporal_namespace)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # Threads for the CPU-bound activities, plus room for sync activities on the main queue (search).
    threads = settings.worker_cpu_concurrency + 4
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as executor:
        worker = build_worker(client, settings, index, executor)
        log.info("worker polling", task_queue=settings.task_queue, temporal=settings.temporal_address,
                 vector_store=settings.qdrant_url or str(settings.qdrant_path))
        async with worker:
            await stop.wait()
            log.info("worker stopping")
    index.close()
    return 0


if __name__ == "__main__":
    code = asyncio.run(main())
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without interpreter teardown: the SDK can crash at exit (temporalio/sdk-python#300).
    os._exit(code)
