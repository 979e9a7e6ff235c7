"""The DAGs alone: the real workflows on the time-skipping test server, with fake activities registered
under the real activities' names (the way the Temporal samples test workflows). No model, no Qdrant,
no embedder: each test says what every step returns and checks what the workflow does with it."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytest_asyncio
from temporalio import activity, workflow
from temporalio.api.enums.v1 import EventType, UpdateWorkflowExecutionLifecycleStage, WorkflowTaskFailedCause
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.api.common.v1 import Payload, WorkflowExecution
from temporalio.api.update.v1 import UpdateRef, WaitPolicy
from temporalio.api.workflowservice.v1 import PollWorkflowExecutionUpdateRequest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.converter import PayloadCodec
from temporalio.exceptions import ApplicationError, CancelledError
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, Worker

import worker
from activities.jobs import JobActivities
from models.agent import AgentInput, AgentResult, PlanInput, PlanOutput, SearchDocumentsInput, SearchDocumentsOutput, \
    Budget, ToolCall, agent_workflow_id
from models.blobs import SweepInput, SweepReport
from models.evaluation import EvaluationInput, EvaluationOutput
from ragline.evaluation import EvaluationReport
from models.chat import (
    AwaitTurnInput, CacheInput, CacheOutput, ChatQuestion, Citation, ContextInput, EntitiesOutput, Entity, GenerateInput, GenerateOutput,
    HistoryItem, RetrieveInput, RetrieveOutput, SessionLeft, SessionRun, SessionRunning, SessionState, SummaryOutput,
    TurnContext, TurnInput, TurnOutcome,
    TurnResult, Usage, session_workflow_id, turn_job_id,
)
from models.jobs import OperatorRequest, StepResult, StepState
from models.tenancy import GateState, JobIds, SlotGrant, SlotRequest
from models.ingest import (
    CANCELLED, CANCELLED_WITH_ITS_UPLOAD, AwaitDocumentInput, ChunkInput, ChunkOutput, DocumentInput, DocumentOutcome,
    EmbedInput, EmbedOutput, ExtractInput, ExtractOutput, ForgetDocumentInput, ForgetDocumentOutput, IndexInput,
    IndexOutput, IngestInput, IngestResult, NewerRun, PruneInput, PruneOutput, RemovalConfirmed, RemoveDocumentInput,
    RemoveInput, SearchInput, SearchOutput, document_workflow_id, removal_workflow_id,
)
from ragline.settings import Settings
from ragline.text import PASSWORD_REQUIRED, WRONG_PASSWORD
from temporal import policies, queues
from temporal import search_attributes as sa
from temporal.converter import build_data_converter
from tests.conftest import SERVER_STARTUP
from tests.helpers import SlowSignals, WaitsForSlot, eventually, time_skipping_server_binary
from workflows.agent import TOLD_TO_STOP, AgentWorkflow
from workflows.blob_sweep import BlobSweepWorkflow
from workflows.chat import ChatSessionWorkflow, ChatTurnWorkflow
from workflows.dead_letters import DeadLetters
from workflows.events import JobEvents
from workflows.gate import TenantGateWorkflow
from workflows.ingest import IngestDocumentWorkflow, IngestWorkflow, _step_names, _upload_failure_type
from workflows import ingest as ingest_workflow
from workflows.remove import RemoveDocumentWorkflow
from workflows.slot import RunningSlot

FAST_POLICIES = Path(__file__).resolve().parent / "fast_policies.toml"
DOC_STEPS = ["extract_text", "chunk_text", "embed_chunks", "index_chunks", "prune_stale_chunks"]

# Each test loads the policies for its fake worker; the session's in-process worker gets its own back.
pytestmark = pytest.mark.usefixtures("restore_policies")


# -- fake activities ---------------------------------------------------------------------------------

@dataclass
class Call:
    name: str
    arg: Any
    queue: str
    attempt: int
    started: int
    finished: int | None = None


@dataclass
class Fakes:
    """Every activity the worker registers, faked, recording each call in order (`started`/`finished`
    are positions on one counter, so "A finished before B started" is `a.finished < b.started`)."""

    fits: bool = True
    cited: list[int] = field(default_factory=lambda: [1, 3, 9])
    extract_fails: dict[str, ApplicationError] = field(default_factory=dict)
    embed_fails_once: bool = False
    embed_rejects: set[int] = field(default_factory=set)  # batches (by start) the embedder refuses for good
    embed_down: set[int] = field(default_factory=set)  # batches (by start) whose every attempt fails, retryably
    embed_held: asyncio.Event | None = None  # the other batches' embeddings wait for it
    index_seconds: float = 0  # how long a batch's write takes
    plan: Callable[[PlanInput], PlanOutput] | None = None
    side_step_seconds: float = 0.2
    ended: set[str] = field(default_factory=set)  # jobs (and sessions) reported as no longer running
    sweeps_fail: int = 0  # how many ended_jobs calls fail (a server too busy to answer)
    removed_documents: set[str] = field(default_factory=set)  # document jobs await_document finds removed
    awaited: Callable[[AwaitDocumentInput], Awaitable[DocumentOutcome]] | None = None  # await_document's answer
    publish_seconds: float = 0  # how long prune_stale_chunks (the publish) takes
    publish_fails: bool = False  # ... and then it fails, retryably
    published: dict[str, int] = field(default_factory=dict)  # chunks found per document, once published
    newer_run: NewerRun = field(default_factory=NewerRun)  # what await_newer_run finds
    remove_held: asyncio.Event | None = None  # remove_document_chunks waits for it
    calls: list[Call] = field(default_factory=list)
    _clock: itertools.count = field(default_factory=itertools.count)

    def _start(self, name: str, arg: Any) -> Call:
        info = activity.info()
        call = Call(name, arg, info.task_queue, info.attempt, next(self._clock))
        self.calls.append(call)
        return call

    def _end(self, call: Call) -> None:
        call.finished = next(self._clock)

    def named(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]

    def one(self, name: str) -> Call:
        [call] = self.named(name)
        return call

    # ingestion
    @activity.defn(name="extract_text")
    async def extract_text(self, req: ExtractInput) -> ExtractOutput:
        call = self._start("extract_text", req)
        self._end(call)
        failure = self.extract_fails.get(req.filename) or self.extract_fails.get(req.blob_ref)  # by name or bytes
        if failure is not None:
            raise failure
        return ExtractOutput(pages_ref=f"pages:{req.document_id}", pages=2, chars=100, attempt=call.attempt)

    @activity.defn(name="chunk_text")
    async def chunk_text(self, req: ChunkInput) -> ChunkOutput:
        call = self._start("chunk_text", req)
        self._end(call)
        return ChunkOutput(chunks_ref=f"chunks:{req.document_id}", chunks=5, batch_size=2, parallelism=2,
                           attempt=call.attempt)

    @activity.defn(name="embed_chunks")
    async def embed_chunks(self, req: EmbedInput) -> EmbedOutput:
        call = self._start("embed_chunks", req)
        self._end(call)
        if self.embed_fails_once and call.attempt == 1 and req.start == 0:
            raise ApplicationError("embedder busy", type="TransientError")
        if req.start in self.embed_down:
            raise ApplicationError("embedder down", type="TransientError")
        if self.embed_held is not None:
            await self.embed_held.wait()
        if req.start in self.embed_rejects:
            await asyncio.sleep(0.3)  # while another batch is being written
            raise ApplicationError("the provider refused this batch", type="ProviderRejectedError", non_retryable=True)
        return EmbedOutput(vectors_ref=f"vectors:{req.chunks_ref}:{req.start}", count=req.end - req.start,
                           model="fake", attempt=call.attempt)

    @activity.defn(name="index_chunks")
    async def index_chunks(self, req: IndexInput) -> IndexOutput:
        call = self._start("index_chunks", req)
        await asyncio.sleep(self.index_seconds)
        self._end(call)
        return IndexOutput(points=req.end - req.start, attempt=call.attempt)

    @activity.defn(name="prune_stale_chunks")
    async def prune_stale_chunks(self, req: PruneInput) -> PruneOutput:
        call = self._start("prune_stale_chunks", req)
        await asyncio.sleep(self.publish_seconds)
        self._end(call)
        if self.publish_fails:
            raise ApplicationError("qdrant busy", type="TransientError")
        self.published[req.document_id] = req.keep_chunks
        return PruneOutput(points=req.keep_chunks, attempt=call.attempt)

    @activity.defn(name="remove_document_chunks")
    async def remove_document_chunks(self, req: RemoveInput) -> PruneOutput:
        call = self._start("remove_document_chunks", req)
        if self.remove_held is not None:
            await self.remove_held.wait()
        self._end(call)
        # As the store answers: a published document has no pending chunks to remove, and its chunks are found.
        return PruneOutput(points=self.published.get(req.document_id, 0), attempt=call.attempt)

    @activity.defn(name="search_chunks")
    async def search_chunks(self, req: SearchInput) -> SearchOutput:
        self._end(self._start("search_chunks", req))
        return SearchOutput(hits=[])

    @activity.defn(name="await_document")
    async def await_document(self, req: AwaitDocumentInput) -> DocumentOutcome:
        self._end(self._start("await_document", req))
        if self.awaited is not None:
            return await self.awaited(req)
        if req.workflow_id in self.removed_documents:
            return DocumentOutcome(document_id=req.workflow_id.rsplit("doc-", 1)[-1], status="removed",
                                   job_id=req.workflow_id)
        return DocumentOutcome.failed_from(req.workflow_id, "not expected in these tests")

    @activity.defn(name="confirm_removal")
    async def confirm_removal(self, req: ForgetDocumentInput) -> RemovalConfirmed:
        self._end(self._start("confirm_removal", req))
        return RemovalConfirmed(at=1_800_000_000.0)

    @activity.defn(name="await_newer_run")
    async def await_newer_run(self, req: ForgetDocumentInput) -> NewerRun:
        self._end(self._start("await_newer_run", req))
        return self.newer_run

    @activity.defn(name="forget_document")
    async def forget_document(self, req: ForgetDocumentInput) -> ForgetDocumentOutput:
        self._end(self._start("forget_document", req))
        return ForgetDocumentOutput(runs=1)

    @activity.defn(name="await_turn")
    async def await_turn(self, req: AwaitTurnInput) -> TurnOutcome:
        self._end(self._start("await_turn", req))
        return TurnOutcome(answer=None)

    # chat
    @activity.defn(name="retrieve_context")
    async def retrieve_context(self, req: RetrieveInput) -> RetrieveOutput:
        call = self._start("retrieve_context", req)
        self._end(call)
        return RetrieveOutput(context_ref=f"ctx:{req.question}", passages=3, fits=self.fits, attempt=call.attempt,
                              citations=[citation(i) for i in (1, 2, 3)])

    @activity.defn(name="summarize_context")
    async def summarize_context(self, req: ContextInput) -> SummaryOutput:
        call = self._start("summarize_context", req)
        await asyncio.sleep(self.side_step_seconds)
        self._end(call)
        return SummaryOutput(summary=f"summary of {req.context_ref}", usage=Usage(prompt_tokens=1, completion_tokens=2))

    @activity.defn(name="generate_answer")
    async def generate_answer(self, req: GenerateInput) -> GenerateOutput:
        call = self._start("generate_answer", req)
        self._end(call)
        return GenerateOutput(answer=f"answer to {req.question}", cited=self.cited, model="fake-model",
                              citations=[citation(i) for i in self.cited if i <= 3],
                              usage=Usage(prompt_tokens=10, completion_tokens=20))

    @activity.defn(name="generate_answer_fallback")
    async def generate_answer_fallback(self, req: GenerateInput) -> GenerateOutput:
        self._end(self._start("generate_answer_fallback", req))
        return GenerateOutput(answer=f"fallback answer to {req.question}", cited=[], model="fake-light")

    @activity.defn(name="cache_answer")
    async def cache_answer(self, req: CacheInput) -> CacheOutput:
        self._end(self._start("cache_answer", req))
        return CacheOutput(stored=True)

    @activity.defn(name="evaluate_collection")
    async def evaluate_collection(self, req: EvaluationInput) -> EvaluationOutput:
        self._end(self._start("evaluate_collection", req))
        return EvaluationOutput(report=EvaluationReport(collection=req.collection, k=req.k, questions=0, in_corpus=0,
                                                        out_of_corpus=0, threshold=0.5), report_ref="blob:report")

    @activity.defn(name="extract_entities")
    async def extract_entities(self, req: ContextInput) -> EntitiesOutput:
        call = self._start("extract_entities", req)
        await asyncio.sleep(self.side_step_seconds)
        self._end(call)
        return EntitiesOutput(entities=[Entity(text="Mara", type="PLACE")], warnings=["a warning"],
                              usage=Usage(prompt_tokens=100, completion_tokens=200))

    # agents
    @activity.defn(name="agent_plan")
    async def agent_plan(self, req: PlanInput) -> PlanOutput:
        call = self._start("agent_plan", req)
        self._end(call)
        assert self.plan is not None, "this test did not say how the agent plans"
        return self.plan(req).model_copy(update={"attempt": call.attempt})

    @activity.defn(name="search_documents")
    async def search_documents(self, req: SearchDocumentsInput) -> SearchDocumentsOutput:
        self._end(self._start("search_documents", req))
        return SearchDocumentsOutput(observation=f"found nothing about {req.query}")

    def all(self) -> list:
        return [self.extract_text, self.chunk_text, self.embed_chunks, self.index_chunks, self.prune_stale_chunks,
                self.remove_document_chunks, self.confirm_removal, self.await_newer_run, self.forget_document,
                self.search_chunks, self.await_document, self.await_turn, self.retrieve_context,
                self.summarize_context, self.generate_answer, self.extract_entities, self.agent_plan,
                self.search_documents, self.generate_answer_fallback, self.cache_answer, self.evaluate_collection,
                self.acquire_slot, self.release_slot, self.ended_jobs, self.session_still_runs, self.sweep_blobs,
                self.session_left, JobActivities(None).policy_attempts]  # the real one: it reads the loaded policy file

    @activity.defn(name="sweep_blobs")
    async def sweep_blobs(self, req: SweepInput) -> SweepReport:
        self._end(self._start("sweep_blobs", req))
        return SweepReport(workflows_read=3, stored=5, deleted=2, bytes_freed=100, dry_run=req.dry_run)

    # running slots: every job gets one at once here, told as the gate would (the gate is tested below)
    @activity.defn(name="acquire_slot")
    async def acquire_slot(self, req: SlotRequest) -> None:
        self._end(self._start("acquire_slot", req))
        await activity.client().get_workflow_handle(req.job_id).signal(
            "slot_update", SlotGrant(ticket=req.ticket, granted=True, running=1, limit=1))

    @activity.defn(name="release_slot")
    async def release_slot(self, req: SlotRequest) -> None:
        self._end(self._start("release_slot", req))

    @activity.defn(name="ended_jobs")
    async def ended_jobs(self, req: JobIds) -> JobIds:
        self._end(self._start("ended_jobs", req))
        if self.sweeps_fail > 0:
            self.sweeps_fail -= 1
            raise ApplicationError("the server is too busy", non_retryable=True)
        return JobIds(job_ids=[j for j in req.job_ids if j in self.ended])

    @activity.defn(name="session_still_runs")
    async def session_still_runs(self, req: SessionRun) -> SessionRunning:
        self._end(self._start("session_still_runs", req))
        return SessionRunning(running=req.workflow_id not in self.ended)

    @activity.defn(name="session_left")
    async def session_left(self, req: SessionRun) -> SessionLeft:
        call = self._start("session_left", req)
        try:
            return await JobActivities(activity.client()).session_left(req)  # the real one: a read of that run
        finally:
            self._end(call)


def citation(i: int) -> Citation:
    return Citation(document_id=f"doc{i}", filename=f"file{i}.pdf", page=i * 10, chunk_id=f"doc{i}:0",
                    score=1 - i / 10)


def finish(answer: str, tokens: int = 15) -> PlanOutput:
    return PlanOutput(calls=[ToolCall(name="finish", arguments={"answer": answer})],
                      prompt_tokens=tokens - 5, completion_tokens=5)


# -- the environment -----------------------------------------------------------------------------------

async def _time_skipping_env(tmp_path_factory) -> WorkflowEnvironment:
    converter = build_data_converter(Settings(data_dir=tmp_path_factory.mktemp("workflow-data")))
    return await WorkflowEnvironment.start_time_skipping(test_server_existing_path=time_skipping_server_binary(),
                                                         data_converter=converter,
                                                         test_server_startup_timeout=SERVER_STARTUP)


@pytest_asyncio.fixture(scope="module")
async def bare_env(tmp_path_factory):
    """A time-skipping server as it comes: without Ragline's search attributes. Jobs started without
    them keep their status in the `progress` query only."""
    env = await _time_skipping_env(tmp_path_factory)
    yield env
    await env.shutdown()


@pytest_asyncio.fixture(scope="module")
async def env(tmp_path_factory):
    """A time-skipping server with Ragline's search attributes added (it implements AddSearchAttributes,
    though not ListSearchAttributes): the workflows that start child jobs give them these attributes,
    and the test server never starts a child whose attributes it does not know."""
    env = await _time_skipping_env(tmp_path_factory)
    await env.client.operator_service.add_search_attributes(AddSearchAttributesRequest(
        namespace=env.client.namespace, search_attributes={k.name: k.indexed_value_type for k in sa.ALL}))
    yield env
    await env.shutdown()


def _on_the_dev_server(stack) -> SimpleNamespace:  # noqa: ANN001
    """The shared stack's real dev server as `fake_worker` takes an environment: through the stack's client,
    so what these workflows leave in its history is encrypted with the stack's keys (a blob sweep of the
    namespace stops at any payload it cannot read)."""
    return SimpleNamespace(client=stack.client)


@asynccontextmanager
async def fake_worker(env: WorkflowEnvironment, fakes: Fakes, queue: str | None = None, *,
                      sticky: bool = True, runs: str = "both"):
    """The real workflows and the fakes on a fresh task queue (or `queue`, to stand for a worker that comes
    back) and its -cpu, -llm and -vector queues, as the worker runs them, under the test policy file loaded
    for the fakes' names. `sticky=False`: no workflow is cached, so no task waits for this worker once it
    has gone (the test server never hands a sticky task on to another worker). `runs`: "workflows" or
    "activities" for one part alone (the fakes go on while no workflow runs, say); one queue takes one of each.
    A worker of workflows alone still runs their local activities (a job's end gives its running slot back in
    one), as the main queue's worker does: without them the end fails the activity and records no marker, and
    its history would not replay."""
    queue = queue or f"wf-{uuid.uuid4().hex[:8]}"
    activities = fakes.all()
    policies.load(FAST_POLICIES, [policies.activity_name(a) for a in activities])
    async with AsyncExitStack() as stack:
        cache = {} if sticky else {"max_cached_workflows": 0}
        parts = {} if runs == "activities" else {"workflows": worker.WORKFLOWS, **cache}
        parts["activities"] = activities
        if runs == "workflows":
            parts["no_remote_activities"] = True  # local activities only
        await stack.enter_async_context(Worker(env.client, task_queue=queue, **parts))
        for kind in ("cpu", "llm", "vector") if runs != "workflows" else ():
            await stack.enter_async_context(Worker(env.client, task_queue=queues.queue_name(queue, kind),
                                                   activities=activities))
        yield queue


async def test_the_blob_sweep_runs_its_step_once_on_the_main_queue_and_returns_its_report(env):
    fakes = Fakes()
    async with fake_worker(env, fakes) as queue:
        report = await env.client.execute_workflow(BlobSweepWorkflow.run, SweepInput(min_age_seconds=86400),
                                                   id=f"sweep-{uuid.uuid4().hex[:6]}", task_queue=queue)
    assert (report.deleted, report.bytes_freed) == (2, 100)
    [call] = fakes.named("sweep_blobs")
    assert (call.arg.min_age_seconds, call.queue) == (86400, queue)


def test_the_fakes_stand_for_every_registered_activity():
    names = [policies.activity_name(a) for a in Fakes().all()]
    assert sorted(names) == sorted(worker.activity_names())


# -- ingestion -----------------------------------------------------------------------------------------

def document(filename: str, collection: str) -> DocumentInput:
    return DocumentInput(document_id=f"{collection}-{uuid.uuid4().hex[:12]}", collection=collection,
                         filename=filename, blob_ref=f"blob:{filename}", sha256="0" * 64, size=10, kind="text")


async def test_files_of_one_name_in_an_upload_are_steps_of_their_own(env):
    fakes = Fakes(extract_fails={"blob:b/report.pdf": ApplicationError(
        "encrypted: password required", type="InputError", non_retryable=True)})
    docs = [document("report.pdf", "c5"), document("report.pdf", "c5")]
    docs[1] = docs[1].model_copy(update={"blob_ref": "blob:b/report.pdf"})
    async with fake_worker(env, fakes) as queue:
        handle = await env.client.start_workflow(IngestWorkflow.run, IngestInput(collection="c5", documents=docs),
                                                 id=f"ingest-{uuid.uuid4().hex[:8]}", task_queue=queue)
        result = await handle.result()
        steps = {s.name: s.status for s in (await handle.query(IngestWorkflow.progress)).steps}
    assert (result.indexed, result.failed) == (1, 1)
    assert steps == {"document:report.pdf": "completed", "document:report.pdf (2)": "failed"}, steps


def test_an_uploads_steps_are_named_apart_even_when_a_file_is_named_like_a_told_apart_one():
    """Three files `a.pdf`, `a.pdf`, `a.pdf (2)`: the second was `a.pdf (2)` too, and the upload's step list
    showed whichever of the two ended last (a failed file could read completed)."""
    docs = [DocumentInput.model_construct(filename=name) for name in ("a.pdf", "a.pdf", "a.pdf (2)", "b.pdf")]
    assert _step_names(docs) == ["document:a.pdf", "document:a.pdf (2)", "document:a.pdf (2) (2)", "document:b.pdf"]


@pytest.mark.parametrize("indexed", [False, True])
async def test_a_removal_takes_what_an_upload_that_reached_the_document_after_it_wrote_unless_it_indexed_it(
        env, indexed):
    """An upload queued before the DELETE started the document's new run once the removal was confirmed.
    The removal keeps what that run writes, waits for its end, and if the run did not index the document
    (it failed, or was cancelled), takes what it wrote too: chunks it rewrote while still found stayed found."""
    fakes = Fakes(newer_run=NewerRun(started=True, indexed=indexed))
    doc_id = f"c6-{uuid.uuid4().hex[:12]}"
    async with fake_worker(env, fakes) as queue:
        result = await env.client.execute_workflow(
            RemoveDocumentWorkflow.run, RemoveDocumentInput(tenant="t", document_id=doc_id, collection="c6",
                                                            filename="a.txt", run_id="r1"),
            id=removal_workflow_id("t", doc_id), task_queue=queue)
    removals = [c.arg for c in fakes.named("remove_document_chunks")]
    assert [r.written_before is None for r in removals] == ([False] if indexed else [False, True])
    assert [c.name for c in fakes.calls][-1] == "forget_document"
    assert result.status in ("removed", "not_found")


async def test_a_removal_leaves_the_chunks_of_a_run_that_began_after_the_failed_newer_run_it_waited_for(
        env, tmp_path):
    """The removal waited for the newer run (an upload queued before the DELETE), which failed; before its next
    step (queued behind other writes on the vector queue), a third upload's run of the document (one waiting
    for that failed run, with its own password) indexed it. That step took every chunk of the document: the
    third run's job stayed completed, the document listed as indexed and found by no search. Only what was
    written before the failed run had ended goes."""
    import time

    from qdrant_client import QdrantClient
    from temporalio.testing import ActivityEnvironment

    from activities.ingest import IngestActivities
    from ragline.blobstore import BlobStore
    from ragline.vectorstore import ChunkPoint, VectorIndex

    doc_id = f"c8-{uuid.uuid4().hex[:12]}"
    index = VectorIndex(QdrantClient(":memory:"), 4, embedded=True)
    store = IngestActivities(Settings(data_dir=tmp_path), BlobStore(tmp_path / "blobs"), None, index)

    def write(chunks: int) -> None:  # a run of the document: its batches, then its publish
        index.upsert("t", "c8", [ChunkPoint(doc_id, i, [1.0, 0.1 * i, 0.0, 0.0], {
            "document_id": doc_id, "filename": "a.txt", "collection": "c8", "page": 1, "chunk": i,
            "text": f"the copper spout, part {i}"}) for i in range(chunks)])
        index.publish("t", "c8", doc_id, chunks)

    @dataclass
    class WithTheStore(Fakes):
        @activity.defn(name="remove_document_chunks")
        async def remove_document_chunks(self, req: RemoveInput) -> PruneOutput:
            self._end(self._start("remove_document_chunks", req))
            return await asyncio.to_thread(ActivityEnvironment().run, store.remove_document_chunks, req)

        @activity.defn(name="await_newer_run")
        async def await_newer_run(self, req: ForgetDocumentInput) -> NewerRun:
            self._end(self._start("await_newer_run", req))
            ended = time.time()  # the newer run has ended, failed; the third run starts and indexes
            await asyncio.sleep(0.01)
            write(3)
            return NewerRun(started=True, indexed=False, at=ended)

    write(5)  # the run the removal was asked for
    fakes = WithTheStore()
    async with fake_worker(env, fakes) as queue:
        result = await env.client.execute_workflow(
            RemoveDocumentWorkflow.run, RemoveDocumentInput(tenant="t", document_id=doc_id, collection="c8",
                                                            filename="a.txt", run_id="r1"),
            id=removal_workflow_id("t", doc_id), task_queue=queue)
    assert result.status == "removed" and len(fakes.named("remove_document_chunks")) == 2
    assert index.count("t", "c8", doc_id, searchable=True) == 3, "the third run's chunks were removed"


async def test_a_removal_cancelled_once_confirmed_finishes(env):
    """Cancelled (the Web UI, the CLI, POST /v1/jobs/{id}/cancel) while its chunks are being removed, a
    confirmed removal finishes and forgets the document. It used to end cancelled: the step, which does not
    stop once started, had taken the chunks, and the document stayed listed as indexed, nobody finding it,
    its same bytes refused as a duplicate."""
    doc_id = f"c7-{uuid.uuid4().hex[:12]}"
    fakes = Fakes(remove_held=asyncio.Event(), published={doc_id: 3})
    async with fake_worker(env, fakes) as queue:
        handle = await env.client.start_workflow(
            RemoveDocumentWorkflow.run, RemoveDocumentInput(tenant="t", document_id=doc_id, collection="c7",
                                                            filename="a.txt", run_id="r1"),
            id=removal_workflow_id("t", doc_id), task_queue=queue)

        async def removing() -> bool:
            return bool(fakes.named("remove_document_chunks"))
        await eventually(removing, what="the chunks being removed")
        await handle.cancel()

        async def cancel_handled() -> bool:  # a workflow task completed after the cancel request
            types = [e.event_type async for e in handle.fetch_history_events()]
            asked = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCEL_REQUESTED
            return asked in types and EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED in types[types.index(asked):]
        await eventually(cancel_handled, what="the cancel handled by the workflow")
        fakes.remove_held.set()
        result = await handle.result()
    assert result.status == "removed", result
    assert [c.name for c in fakes.calls][-1] == "forget_document"


async def test_ingest_fans_out_one_child_per_document_and_a_bad_one_fails_alone(env):
    fakes = Fakes(extract_fails={"locked.pdf": ApplicationError("encrypted: password required", type="InputError",
                                                               non_retryable=True)},
                  embed_fails_once=True)
    docs = [document("a.txt", "c1"), document("locked.pdf", "c1"), document("b.txt", "c1")]
    async with fake_worker(env, fakes) as queue:
        job_id = f"ingest-{uuid.uuid4().hex[:8]}"
        result = await env.client.execute_workflow(IngestWorkflow.run, IngestInput(collection="c1", documents=docs),
                                                   id=job_id, task_queue=queue)
        assert isinstance(result, IngestResult)
        assert (result.indexed, result.failed) == (2, 1)
        outcomes = {o.filename: o for o in result.documents}
        assert [o.filename for o in result.documents] == ["a.txt", "locked.pdf", "b.txt"]  # the upload's order
        for name, doc in (("a.txt", docs[0]), ("b.txt", docs[2])):
            assert outcomes[name].status == "indexed" and (outcomes[name].pages, outcomes[name].chunks) == (2, 5)
            assert outcomes[name].job_id == document_workflow_id(doc.tenant, doc.document_id)
        locked = outcomes["locked.pdf"]
        assert locked.status == "failed" and locked.error == "encrypted: password required"
        assert locked.job_id == document_workflow_id(docs[1].tenant, docs[1].document_id)

        # Bad input is not retried, and nothing after extraction ran for it.
        locked_calls = [c for c in fakes.calls if getattr(c.arg, "document_id", None) == docs[1].document_id]
        assert [(c.name, c.attempt) for c in locked_calls] == [("extract_text", 1)]

        # Every good document: extract -> chunk -> each batch embedded then indexed, once -> prune last.
        for doc in (docs[0], docs[2]):
            chunks_ref = f"chunks:{doc.document_id}"
            mine = [c for c in fakes.calls if getattr(c.arg, "document_id", None) == doc.document_id
                    or getattr(c.arg, "chunks_ref", None) == chunks_ref]
            extract, chunk, prune = (next(c for c in mine if c.name == n)
                                     for n in ("extract_text", "chunk_text", "prune_stale_chunks"))
            embeds = [c for c in mine if c.name == "embed_chunks" and c.finished is not None]
            indexes = [c for c in mine if c.name == "index_chunks"]
            assert extract.finished < chunk.started
            ok_embeds = {(c.arg.start, c.arg.end): c for c in embeds if not (c.attempt == 1 and c.arg.start == 0)}
            assert sorted(ok_embeds) == [(0, 2), (2, 4), (4, 5)]
            assert sorted((c.arg.start, c.arg.end) for c in indexes) == [(0, 2), (2, 4), (4, 5)]
            for index in indexes:
                embed = ok_embeds[(index.arg.start, index.arg.end)]
                assert embed.finished < index.started
                assert index.arg.vectors_ref == f"vectors:{chunks_ref}:{index.arg.start}"
            assert all(c.finished < prune.started for c in [chunk, *embeds, *indexes])
            assert prune.arg.keep_chunks == 5

        # The policy file routes the ingestion steps to the cpu queue, and the store's to the vector queue.
        assert {c.name: c.queue for c in fakes.calls} == {
            **{n: queues.queue_name(queue, "cpu") for n in ("extract_text", "chunk_text", "embed_chunks")},
            **{n: queues.queue_name(queue, "vector") for n in ("index_chunks", "prune_stale_chunks")}}

        # Each document's own job shows the five steps, with the retried batch's attempts.
        good = await env.client.get_workflow_handle(document_workflow_id(docs[0].tenant, docs[0].document_id)).query(
            IngestDocumentWorkflow.progress)
        assert [s.name for s in good.steps] == DOC_STEPS
        assert all(s.status == "completed" and s.started_at <= s.finished_at for s in good.steps)
        steps = {s.name: s for s in good.steps}
        assert steps["embed_chunks"].attempts == 2 and steps["embed_chunks"].detail == "3/3 batches"
        assert steps["index_chunks"].detail == "3/3 batches" and steps["chunk_text"].attempts == 1
        bad = await env.client.get_workflow_handle(document_workflow_id(docs[1].tenant, docs[1].document_id)).query(
            IngestDocumentWorkflow.progress)
        assert [(s.name, s.status) for s in bad.steps] == [("extract_text", "failed")] + [
            (name, "skipped") for name in DOC_STEPS[1:]]
        assert bad.steps[0].error == "encrypted: password required"

        parent = await env.client.get_workflow_handle(job_id).query(IngestWorkflow.progress)
        assert {s.name: s.status for s in parent.steps} == {
            "document:a.txt": "completed", "document:locked.pdf": "failed", "document:b.txt": "completed"}


async def test_document_job_tolerates_a_server_without_ragline_search_attributes(bare_env):
    fakes = Fakes()
    doc = document("a.txt", "bare")
    async with fake_worker(bare_env, fakes) as queue:
        handle = await bare_env.client.start_workflow(IngestDocumentWorkflow.run, doc,
                                                      id=document_workflow_id(doc.tenant, doc.document_id), task_queue=queue)

        async def ended_or_stuck():
            history = (await handle.fetch_history()).events
            failed = [e.workflow_task_failed_event_attributes.cause for e in history
                      if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED]
            done = history[-1].event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED
            return (done, failed) if done or failed else None

        done, failed = await eventually(ended_or_stuck, timeout=20, what="the document job ending")
    assert WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_BAD_SEARCH_ATTRIBUTES not in failed
    assert done


async def test_an_upload_that_finds_its_document_removed_since_ingests_it_anew(env):
    """An earlier upload indexed the document, and a removal (DELETE) took it out before this upload reached
    it: the upload runs the document's job again instead of taking the earlier outcome as its own."""
    doc = document("a.txt", "removed")
    child_id = document_workflow_id(doc.tenant, doc.document_id)
    fakes = Fakes(removed_documents={child_id})
    async with fake_worker(env, fakes) as queue:
        first = await env.client.execute_workflow(IngestDocumentWorkflow.run, doc, id=child_id, task_queue=queue)
        assert first.status == "indexed"
        upload = IngestInput(collection="removed", documents=[doc])
        result = await env.client.execute_workflow(IngestWorkflow.run, upload, id=f"ingest-{uuid.uuid4().hex[:8]}",
                                                   task_queue=queue)
    assert [(o.status, o.job_id) for o in result.documents] == [("indexed", child_id)]
    [asked] = fakes.named("await_document")
    assert asked.arg.removal_id == removal_workflow_id(doc.tenant, doc.document_id)
    assert len(fakes.named("extract_text")) == 2  # the document's job ran again


async def test_an_upload_whose_document_was_removed_again_while_it_ran_does_not_blame_the_file(env):
    """The upload found its document removed since, went to run it anew, found another upload's run of it and
    saw that removed too. The file is not at fault: the upload failed with type InputError ("send them again
    only changed", README), which tells a client never to send the same file again."""
    doc = document("a.txt", "removed-twice")
    child_id = document_workflow_id(doc.tenant, doc.document_id)
    fakes = Fakes(removed_documents={child_id})
    async with fake_worker(env, fakes) as queue:
        # Another upload's run of the document, on a queue nobody polls: every start of it here is refused.
        await env.client.start_workflow(IngestDocumentWorkflow.run, doc, id=child_id,
                                        task_queue=f"nobody-{uuid.uuid4().hex[:6]}")
        with pytest.raises(WorkflowFailureError) as failure:
            await env.client.execute_workflow(IngestWorkflow.run, IngestInput(collection="removed-twice",
                                                                              documents=[doc]),
                                              id=f"ingest-{uuid.uuid4().hex[:8]}", task_queue=queue)
    assert len(fakes.named("await_document")) == 2
    cause = failure.value.cause
    assert isinstance(cause, ApplicationError) and "removed again while this upload ran" in cause.message
    assert cause.type == "Removed", cause.type
    assert cause.details[0]["documents"][0]["error_type"] == "Removed", cause.details


@pytest.mark.parametrize("cancelled, runs_it", [(CANCELLED_WITH_ITS_UPLOAD, True), (CANCELLED, False)])
async def test_an_upload_runs_the_document_itself_when_the_upload_whose_run_it_waited_for_was_cancelled(
        env, cancelled, runs_it):
    """Upload A started the document's job (held here on a queue nobody polls); upload B, with the same file,
    waits for that run. A person cancels upload A: B runs the document itself instead of failing its copy. A
    person who cancelled the document's own job meant the document: B's copy shows cancelled."""
    doc = document("report.pdf", "shared")
    child_id = document_workflow_id(doc.tenant, doc.document_id)
    held = await env.client.start_workflow(IngestDocumentWorkflow.run, doc, id=child_id,
                                           task_queue=f"nobody-{uuid.uuid4().hex[:6]}")

    async def cancelled_meanwhile(req: AwaitDocumentInput) -> DocumentOutcome:
        await held.terminate(reason="test: cancelled")
        return DocumentOutcome.failed_from(req.workflow_id, cancelled)
    fakes = Fakes(awaited=cancelled_meanwhile)
    async with fake_worker(env, fakes) as queue:
        upload = IngestInput(collection="shared", documents=[doc, document("notes.txt", "shared")])
        handle = await env.client.start_workflow(IngestWorkflow.run, upload, id=f"ingest-{uuid.uuid4().hex[:8]}",
                                                 task_queue=queue)
        result = await handle.result()
        steps = {s.name: s.status for s in (await handle.query(IngestWorkflow.progress)).steps}
    outcome = result.documents[0]
    assert (outcome.status, outcome.job_id) == (("indexed", child_id) if runs_it else ("failed", child_id))
    assert steps["document:report.pdf"] == ("completed" if runs_it else "cancelled"), steps
    assert len(fakes.named("extract_text")) == (2 if runs_it else 1)  # report.pdf (when run), notes.txt


@pytest.mark.parametrize("password, refusal, runs_it", [
    ("right", WRONG_PASSWORD, True), ("right", PASSWORD_REQUIRED, True),
    (None, PASSWORD_REQUIRED, False), ("right", "corrupt PDF: bad xref", False)])
async def test_an_upload_with_a_password_runs_a_document_that_failed_on_another_uploads(
        env, password, refusal, runs_it):
    """Upload A (a wrong password, or none) started the document's job; upload B, the same file with a
    password of its own, waits for that run, which fails on A's password: B runs the document once with its
    own instead of failing its copy. Any other failure of the document stands for B too."""
    doc = document("report.pdf", "locked").model_copy(update={"password": password})
    child_id = document_workflow_id(doc.tenant, doc.document_id)
    held = await env.client.start_workflow(IngestDocumentWorkflow.run, doc, id=child_id,
                                           task_queue=f"nobody-{uuid.uuid4().hex[:6]}")

    async def failed_meanwhile(req: AwaitDocumentInput) -> DocumentOutcome:
        await held.terminate(reason="test: failed")
        return DocumentOutcome.failed_from(req.workflow_id, f"step extract_text failed: {refusal}")
    fakes = Fakes(awaited=failed_meanwhile)
    async with fake_worker(env, fakes) as queue:
        upload = env.client.execute_workflow(IngestWorkflow.run, IngestInput(collection="locked", documents=[doc]),
                                             id=f"ingest-{uuid.uuid4().hex[:8]}", task_queue=queue)
        if runs_it:
            [outcome] = (await upload).documents
            assert (outcome.status, outcome.job_id) == ("indexed", child_id)
        else:
            with pytest.raises(WorkflowFailureError) as failed:  # its only document failed
                await upload
            assert refusal in str(failed.value.cause)
    assert [c.arg.password for c in fakes.named("extract_text")] == ([password] if runs_it else [])


async def test_an_upload_waiting_for_a_document_tells_a_cancel_of_its_upload_from_one_of_the_document(
        stack):
    """The real `await_document`: a document run cancelled because the upload that started it was cancelled
    (its parent asked) is told from one a person cancelled directly. (On the real dev server: the time-skipping
    one does not say who asked for a cancel.)"""
    from temporalio.testing import ActivityEnvironment

    from activities.jobs import JobActivities

    env = _on_the_dev_server(stack)

    for by_its_upload in (True, False):
        fakes = Fakes(embed_held=asyncio.Event())
        doc = document("a.txt", "which-cancel")
        child_id = document_workflow_id(doc.tenant, doc.document_id)
        async with fake_worker(env, fakes) as queue:
            upload = await env.client.start_workflow(IngestWorkflow.run, IngestInput(collection="c", documents=[doc]),
                                                     id=f"ingest-{uuid.uuid4().hex[:8]}", task_queue=queue)
            await eventually(lambda: _asyncify(fakes.named("embed_chunks")), timeout=20, what="the document running")
            waiting = asyncio.create_task(ActivityEnvironment().run(
                JobActivities(env.client).await_document, AwaitDocumentInput(workflow_id=child_id)))
            await (upload if by_its_upload else env.client.get_workflow_handle(child_id)).cancel()
            outcome = await asyncio.wait_for(waiting, 30)
            fakes.embed_held.set()
            with pytest.raises(WorkflowFailureError):
                await upload.result()
        assert outcome.error == (CANCELLED_WITH_ITS_UPLOAD if by_its_upload else CANCELLED), (by_its_upload, outcome)


async def test_a_cancel_during_the_publish_comes_too_late_and_the_document_is_indexed(env):
    """The publish makes every chunk of the document found at once: a cancel that arrives while it runs
    lets it end, and the job completes with the document indexed (not cancelled with its chunks found)."""
    fakes = Fakes(publish_seconds=1.5)
    doc = document("a.txt", "late-cancel")
    async with fake_worker(env, fakes) as queue:
        handle = await env.client.start_workflow(IngestDocumentWorkflow.run, doc, task_queue=queue,
                                                 id=document_workflow_id(doc.tenant, doc.document_id))
        await eventually(lambda: _asyncify(fakes.named("prune_stale_chunks")), timeout=20, what="the publish")
        await handle.cancel()
        outcome = await handle.result()
    assert outcome.status == "indexed" and outcome.chunks == 5
    assert not fakes.named("remove_document_chunks"), fakes.calls


async def test_a_publish_that_ends_as_the_cancel_comes_stands(env):
    """No workflow worker runs while the publish ends and a person cancels: both reach the job in one
    workflow task, and the SDK raises the cancel in place of the publish's result. The undo finds the
    document published (nothing pending, its chunks found), and the job completes with it indexed (it ended
    cancelled with every chunk of its document found)."""
    fakes = Fakes(publish_seconds=1.0)
    doc = document("a.txt", "cancel-with-publish")
    async with fake_worker(env, fakes, runs="activities") as queue:
        async with fake_worker(env, fakes, queue, sticky=False, runs="workflows"):
            handle = await env.client.start_workflow(IngestDocumentWorkflow.run, doc, task_queue=queue,
                                                     id=document_workflow_id(doc.tenant, doc.document_id))
            await eventually(lambda: _asyncify(fakes.named("prune_stale_chunks")), timeout=20, what="the publish")

        async def published() -> bool:  # recorded, with no workflow worker to see it
            return any([e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED and
                        e.activity_task_completed_event_attributes.scheduled_event_id == scheduled
                        async for e in handle.fetch_history_events()])
        scheduled = max([e.event_id async for e in handle.fetch_history_events()
                         if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED])
        await eventually(published, timeout=20, what="the publish's completion in the history")
        await handle.cancel()
        async with fake_worker(env, fakes, queue, runs="workflows"):
            outcome = await handle.result()
            steps = {s.name: s.status for s in (await handle.query(IngestDocumentWorkflow.progress)).steps}
    assert outcome.status == "indexed" and outcome.chunks == 5
    assert steps["prune_stale_chunks"] == "completed", steps
    assert fakes.one("remove_document_chunks").arg.pending_only  # it removed nothing: nothing was pending


@pytest.mark.parametrize("removed, found, landed", [
    (0, 5, True),  # nothing pending any more, this chunking's 5 chunks found
    (5, 0, False),  # its pending chunks were removed: the publish never ran
    (0, 8, False),  # an older chunking's 8 chunks are still found: this run's publish (which prunes) did not land
    (0, 0, False)])
def test_the_undo_after_a_cancel_tells_a_publish_that_landed(removed, found, landed):
    assert ingest_workflow._published(PruneOutput(points=found, removed=removed), chunks=5) is landed


async def test_a_cancel_during_a_publish_that_then_fails_ends_the_job_cancelled(stack):
    """Asked to cancel, the server does not retry the publish that then fails: that is the job's cancel (it
    ended failed, "qdrant busy", with nothing retried), and the document's pending chunks go. (On the real
    dev server: the time-skipping one retries the failed attempt all the same.)"""
    fakes = Fakes(publish_seconds=1.5, publish_fails=True)
    doc = document("a.txt", "late-cancel-fails")
    env = _on_the_dev_server(stack)
    async with fake_worker(env, fakes) as queue:
        handle = await env.client.start_workflow(IngestDocumentWorkflow.run, doc, task_queue=queue,
                                                 id=document_workflow_id(doc.tenant, doc.document_id))
        await eventually(lambda: _asyncify(fakes.named("prune_stale_chunks")), timeout=20, what="the publish")
        await handle.cancel()
        with pytest.raises(WorkflowFailureError) as ended:
            await handle.result()
        steps = {s.name: s.status for s in (await handle.query(IngestDocumentWorkflow.progress)).steps}
    assert isinstance(ended.value.cause, CancelledError), ended.value.cause
    assert steps["prune_stale_chunks"] == "cancelled" and len(fakes.named("prune_stale_chunks")) == 1
    assert fakes.one("remove_document_chunks").arg.pending_only


class HoldsAPayload(PayloadCodec):
    """The worker's codec, holding the first payload it encodes that holds `marker` until `go` is set:
    a workflow task's commands wait there, the task still open, for what the test does meanwhile."""

    def __init__(self, inner: PayloadCodec | None, marker: bytes) -> None:
        self.inner, self.marker = inner, marker
        self.reached, self.go = asyncio.Event(), asyncio.Event()

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        if not self.reached.is_set() and any(self.marker in p.data for p in payloads):
            self.reached.set()
            await self.go.wait()
        return await self.inner.encode(payloads) if self.inner else list(payloads)

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return await self.inner.decode(payloads) if self.inner else list(payloads)


async def test_a_cancel_that_comes_while_a_documents_job_is_being_started_cancels_that_job(stack):
    """The upload's cancel reaches it in the workflow task that brings its document's job's start (held here
    while the task that starts it is open): that job is cancelled too, and its chunks are not published. It
    ran on, embedded and indexed, for an upload that read cancelled (the cancel the SDK sent as the upload
    ended was dropped). On the real dev server."""
    doc = document(f"starting-{uuid.uuid4().hex[:8]}.txt", "cancel-while-starting")
    dc = stack.client.data_converter
    held = HoldsAPayload(dc.payload_codec, marker=doc.filename.encode())
    holding = Client(**{**stack.client.config(), "data_converter": dataclasses.replace(dc, payload_codec=held)})
    fakes = Fakes(index_seconds=2.0)  # the document's job is still writing when its cancel comes
    async with fake_worker(SimpleNamespace(client=holding), fakes) as queue:
        handle = await stack.client.start_workflow(IngestWorkflow.run, IngestInput(collection=doc.collection,
                                                                                   documents=[doc]),
                                                   id=f"ingest-{uuid.uuid4().hex[:8]}", task_queue=queue)
        await asyncio.wait_for(held.reached.wait(), 30)  # the task that starts the document's job is open
        await handle.cancel()
        held.go.set()
        with pytest.raises(WorkflowFailureError) as ended:
            await handle.result()
        child = stack.client.get_workflow_handle(document_workflow_id(doc.tenant, doc.document_id))
        events = [e.event_type async for e in handle.fetch_history_events()]
        assert events.index(EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCEL_REQUESTED) < \
            events.index(EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_STARTED), "the cancel came after the start"
        assert (await child.describe()).status == WorkflowExecutionStatus.CANCELED
        replayed = await Replayer(workflows=worker.WORKFLOWS, data_converter=dc).replay_workflow(
            await handle.fetch_history(), raise_on_replay_failure=False)
    assert replayed.replay_failure is None, replayed.replay_failure
    assert isinstance(ended.value.cause, CancelledError), ended.value.cause
    assert fakes.named("prune_stale_chunks") == [], "a cancelled upload's document was published"


async def test_a_failed_document_removes_its_chunks_after_the_batches_in_flight_have_ended(env):
    """Batch 2 of a document is refused while batch 0 is being written: the undo runs after that
    write, not before it (a late write would leave a failed document's chunks searchable)."""
    fakes = Fakes(embed_rejects={2}, index_seconds=1.0)
    doc = document("a.txt", "settle")
    async with fake_worker(env, fakes) as queue:
        with pytest.raises(WorkflowFailureError) as failure:
            await env.client.execute_workflow(IngestDocumentWorkflow.run, doc, task_queue=queue,
                                              id=document_workflow_id(doc.tenant, doc.document_id))
        steps = {s.name: s for s in (await env.client.get_workflow_handle(
            document_workflow_id(doc.tenant, doc.document_id)).query(IngestDocumentWorkflow.progress)).steps}
    assert "the provider refused this batch" in str(failure.value.cause)
    undo = fakes.one("remove_document_chunks")
    writes = fakes.named("index_chunks")
    assert writes and all(w.finished is not None and w.finished < undo.started for w in writes), fakes.calls
    assert steps["embed_chunks"].status == "failed"
    # Only what this run wrote, never published: an earlier run's published chunks of the same bytes stay.
    assert undo.arg.pending_only


async def test_a_parked_batch_shows_its_step_parked_while_the_batches_after_it_run(env):
    """Batch 0's embeddings fail until it parks; batch 4 only starts after that (batch 2 holds the other
    place). The step stays shown as waiting for an operator, not running, and an operator's discard
    ends the job failed."""
    fakes = Fakes(embed_down={0}, embed_held=asyncio.Event())
    doc = document("a.txt", "parked-batch")
    async with fake_worker(env, fakes) as queue:
        handle = await env.client.start_workflow(IngestDocumentWorkflow.run, doc, task_queue=queue,
                                                 id=document_workflow_id(doc.tenant, doc.document_id))

        async def steps_when(ready: Callable[[dict[str, StepState]], bool]) -> dict[str, StepState] | None:
            steps = {s.name: s for s in (await handle.query(IngestDocumentWorkflow.progress)).steps}
            return steps if ready(steps) else None

        await eventually(lambda: steps_when(lambda s: s["embed_chunks"].status == "dead_lettered"), timeout=20,
                         what="batch 0 parked")
        fakes.embed_held.set()
        steps = await eventually(lambda: steps_when(lambda s: s["index_chunks"].detail == "2/3 batches"), timeout=20,
                                 what="batches 2 and 4 indexed")
        assert [c.arg.start for c in fakes.named("index_chunks")] == [2, 4]
        assert steps["embed_chunks"].status == "dead_lettered", steps
        assert steps["embed_chunks"].detail == "2/3 batches", steps
        await handle.execute_update("discard", OperatorRequest(operator="ops"))
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        steps = {s.name: s.status for s in (await handle.query(IngestDocumentWorkflow.progress)).steps}
    assert steps["embed_chunks"] == "failed", steps


async def test_a_cancelled_document_removes_its_chunks_after_the_write_in_flight_has_ended(env):
    fakes = Fakes(index_seconds=1.0)
    doc = document("a.txt", "settle2")
    async with fake_worker(env, fakes) as queue:
        handle = await env.client.start_workflow(IngestDocumentWorkflow.run, doc, task_queue=queue,
                                                 id=document_workflow_id(doc.tenant, doc.document_id))
        await eventually(lambda: _asyncify(fakes.named("index_chunks")), timeout=20, what="a batch being written")
        await handle.cancel()
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        steps = {s.name: s.status for s in (await handle.query(IngestDocumentWorkflow.progress)).steps}
    undo = fakes.one("remove_document_chunks")
    assert all(w.finished is not None and w.finished < undo.started for w in fakes.named("index_chunks")), fakes.calls
    # Its batches stopped: the job's view says so rather than "running" for ever.
    assert steps["embed_chunks"] == steps["index_chunks"] == "cancelled", steps


async def _asyncify(value):
    return value


async def test_ingest_with_no_good_document_fails_with_every_reason(env):
    bad = ApplicationError("no extractable text", type="InputError", non_retryable=True)
    fakes = Fakes(extract_fails={"scan.pdf": bad, "scan2.pdf": bad})
    docs = [document("scan.pdf", "c2"), document("scan2.pdf", "c2")]
    async with fake_worker(env, fakes) as queue:
        with pytest.raises(WorkflowFailureError) as failure:
            await env.client.execute_workflow(IngestWorkflow.run, IngestInput(collection="c2", documents=docs),
                                              id=f"ingest-{uuid.uuid4().hex[:8]}", task_queue=queue)
    cause = failure.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "InputError" and cause.non_retryable
    assert cause.message == ("no document could be ingested: scan.pdf: no extractable text; "
                             "scan2.pdf: no extractable text")
    assert [c.name for c in fakes.calls] == ["extract_text", "extract_text"]


def test_a_failed_uploads_type_says_whose_doing_it_was():
    def failed(error: str, kind: str | None) -> DocumentOutcome:
        return DocumentOutcome.failed_from("t.doc-x", error, "f.pdf", kind)
    assert _upload_failure_type([failed("no extractable text", "InputError"), failed("corrupt", None)]) == "InputError"
    assert _upload_failure_type([failed(CANCELLED, "Cancelled"), failed(CANCELLED, None)]) == "Cancelled"
    assert _upload_failure_type([failed("discarded by ana", "Discarded"), failed(CANCELLED, "Cancelled")]) == \
        "Discarded"  # the cancelled one was a person's doing: the other says what became of the upload
    assert _upload_failure_type([failed("discarded by ana", "Discarded"), failed("corrupt", "InputError")]) == \
        "DocumentsFailed"


# -- chat ----------------------------------------------------------------------------------------------

def turn(session: str, message: str, *, key: str | None = None) -> TurnInput:
    return TurnInput(job_id=turn_job_id(session, key or uuid.uuid4().hex), session_id=session,
                     question=ChatQuestion(message=message, collection="wf-chat", top_k=3))


async def turn_result(env: WorkflowEnvironment, job_id: str) -> TurnResult:
    """The result of a turn's job, which its session starts on its own time."""
    handle = env.client.get_workflow_handle(job_id, result_type=TurnResult)

    async def started() -> bool:
        try:
            await handle.describe()
        except RPCError:
            return False
        return True

    await eventually(started, timeout=20, what=f"the session starting {job_id}")
    return await handle.result()


async def _history_events(handle) -> list[int]:
    return [e.event_type for e in (await handle.fetch_history()).events]


async def test_chat_turn_waits_for_its_go_then_answers_before_the_side_steps(bare_env):
    env = bare_env
    fakes = Fakes(fits=True)
    async with fake_worker(env, fakes) as queue:
        inp = turn("s1", "When do zebras cross?")
        handle = await env.client.start_workflow(ChatTurnWorkflow.run, inp, id=inp.job_id, task_queue=queue)
        # Queued until the session says go: the query is answered, and no activity has been scheduled.
        progress = await handle.query(ChatTurnWorkflow.progress)
        assert progress.status == "queued"
        assert [(s.name, s.status) for s in progress.steps] == [
            ("retrieve_context", "pending"), ("generate_answer", "pending"), ("summarize_context", "pending"),
            ("extract_entities", "pending")]
        assert EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED not in await _history_events(handle)
        assert fakes.calls == []

        history = [HistoryItem(question="Where?", answer="In the Mara.")]
        await handle.signal(ChatTurnWorkflow.proceed, TurnContext(history=history))
        result = await handle.result()

    retrieve, generate = fakes.one("retrieve_context"), fakes.one("generate_answer")
    summarize, entities = fakes.one("summarize_context"), fakes.one("extract_entities")
    # The answer waits for nothing but retrieval; the side steps start after it, side by side.
    assert retrieve.finished < generate.started
    assert generate.finished < summarize.started and generate.finished < entities.started
    assert summarize.started < entities.finished and entities.started < summarize.finished
    # What each step was given.
    # The question before it goes along, for a follow-up that names its topic only there.
    assert retrieve.arg == RetrieveInput(question="When do zebras cross?", collection="wf-chat", top_k=3, follows="Where?")
    assert generate.arg.context_ref == "ctx:When do zebras cross?" and generate.arg.summary is None
    assert generate.arg.history == history
    assert summarize.arg == entities.arg == ContextInput(question="When do zebras cross?",
                                                        context_ref="ctx:When do zebras cross?")
    # Model calls go to the llm queue, retrieval to the cpu queue.
    assert {c.name: c.queue for c in fakes.calls} == {
        "retrieve_context": queues.queue_name(queue, "vector"), "generate_answer": queues.queue_name(queue, "llm"),
        "summarize_context": queues.queue_name(queue, "llm"), "extract_entities": queues.queue_name(queue, "llm")}

    assert isinstance(result, TurnResult)
    assert result.answer == "answer to When do zebras cross?" and result.model == "fake-model"
    # Cited passages 1 and 3 map to the first and third retrieved passages, in that order; 9 does not exist.
    assert result.citations == [citation(1), citation(3)]
    assert result.summary == "summary of ctx:When do zebras cross?"
    assert result.entities == [Entity(text="Mara", type="PLACE")] and result.warnings == ["a warning"]
    assert result.usage == Usage(prompt_tokens=111, completion_tokens=222)
    assert (result.session_id, result.question) == ("s1", "When do zebras cross?")


async def test_chat_turn_summarizes_first_when_the_passages_do_not_fit(bare_env):
    env = bare_env
    fakes = Fakes(fits=False, cited=[])
    async with fake_worker(env, fakes) as queue:
        inp = turn("s2", "Tell me everything.")
        handle = await env.client.start_workflow(ChatTurnWorkflow.run, inp, id=inp.job_id, task_queue=queue)
        await handle.signal(ChatTurnWorkflow.proceed, TurnContext())
        result = await handle.result()
    retrieve, summarize = fakes.one("retrieve_context"), fakes.one("summarize_context")
    generate, entities = fakes.one("generate_answer"), fakes.one("extract_entities")
    assert retrieve.finished < summarize.started and summarize.finished < generate.started
    assert generate.finished < entities.started
    # The answer works from the summary, which is not asked for twice.
    assert generate.arg.summary == "summary of ctx:Tell me everything." == result.summary
    assert result.citations == []
    assert result.usage == Usage(prompt_tokens=111, completion_tokens=222)


async def test_chat_turn_started_with_its_go_needs_no_signal(bare_env):
    # The session gives the first turn of an idle session its go with its start.
    env = bare_env
    fakes = Fakes(side_step_seconds=0)
    history = [HistoryItem(question="Before?", answer="Yes.")]
    async with fake_worker(env, fakes) as queue:
        inp = turn("s3", "Now?").model_copy(update={"context": TurnContext(history=history)})
        result = await env.client.execute_workflow(ChatTurnWorkflow.run, inp, id=inp.job_id, task_queue=queue)
    assert result.answer == "answer to Now?"
    assert fakes.one("generate_answer").arg.history == history


async def start_session(env: WorkflowEnvironment, queue: str, first: TurnInput, *, resumed_from: str | None = None,
                        **state: Any):
    """A session's workflow, started by its first turn as `POST /v1/chats` starts it (signal-with-start); again
    after a run of it ended (`resumed_from`: that run's id). `state`: other fields of its SessionState."""
    return await env.client.start_workflow(
        ChatSessionWorkflow.run, SessionState(session_id=first.session_id, resumed_from=resumed_from, **state),
        id=session_workflow_id("default", first.session_id), task_queue=queue, start_signal="submit",
        start_signal_args=[first])


@dataclass
class FirstRefusedCacheDown(Fakes):
    """No passage supports the first question (its answer is the refusal), and the answer cache cannot take
    a write (the vector role restarting, say): every attempt of cache_answer fails, retryably."""

    @activity.defn(name="retrieve_context")
    async def retrieve_context(self, req: RetrieveInput) -> RetrieveOutput:
        if not req.question.startswith("First"):
            return await super().retrieve_context(req)
        self._end(call := self._start("retrieve_context", req))
        return RetrieveOutput(context_ref="ctx:none", passages=0, citations=[], supported=False,
                              refusal="No passage of the collection answers this.", cache_key="k-first",
                              attempt=call.attempt)

    @activity.defn(name="cache_answer")
    async def cache_answer(self, req: CacheInput) -> CacheOutput:
        self._end(self._start("cache_answer", req))
        raise ApplicationError("the answer cache is not reachable")


async def test_a_refusal_whose_cache_write_fails_ends_answered_and_holds_no_later_turn(env):
    """A refusal is final once shown: the next turn goes on at once, and a cache write that used up its retries
    leaves its step failed. The turn parked for an operator instead, and every later turn of the session with it
    (up to the dead letters' 7 days); an operator's discard then failed a turn whose answer the person had."""
    fakes = FirstRefusedCacheDown(side_step_seconds=0)
    session = f"s-{uuid.uuid4().hex[:8]}"
    first, second = turn(session, "First question?"), turn(session, "Second question?")
    async with fake_worker(env, fakes) as queue:
        handle = await start_session(env, queue, first)
        await handle.signal(ChatSessionWorkflow.submit, second)
        refused = await turn_result(env, first.job_id)
        answered = await turn_result(env, second.job_id)
        progress = await env.client.get_workflow_handle(first.job_id).query(ChatTurnWorkflow.progress)
        await handle.terminate("test over")
    assert refused.answer == "No passage of the collection answers this." and not refused.supported
    assert answered.answer == "answer to Second question?"
    assert len(fakes.named("cache_answer")) == policies.policy("cache_answer").retry.maximum_attempts
    assert {s.name: s.status for s in progress.steps}["cache_answer"] == "failed"
    # The refusal is no answer: the next question is asked without it.
    assert fakes.one("generate_answer").arg.history == []


async def test_a_carried_turn_whose_job_is_gone_reads_as_ended_without_an_answer(env, restore_policies):
    """A session waits for a turn an earlier run started (await_turn, retried without limit); a job gone since
    (deleted, past the retention) failed every attempt: the session, and every later turn of it, waited for ever."""
    from temporalio.testing import ActivityEnvironment

    policies.load(FAST_POLICIES, worker.activity_names())  # its errors are told apart by them
    gone = AwaitTurnInput(workflow_id=turn_job_id(f"s-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex))
    assert await ActivityEnvironment().run(JobActivities(env.client).await_turn, gone) == TurnOutcome(answer=None)


@dataclass
class TurnsAwaitedForReal(Fakes):
    """await_turn is the real one: it returns when the turn's job has ended."""

    @activity.defn(name="await_turn")
    async def await_turn(self, req: AwaitTurnInput) -> TurnOutcome:
        call = self._start("await_turn", req)
        try:
            return await JobActivities(activity.client()).await_turn(req)
        finally:
            self._end(call)


async def test_an_answer_told_as_the_session_continued_as_new_is_the_next_runs(env):
    """A turn tells its session its final answer once. Told to a run that had chosen to continue as new (a
    reviewer released it as the run grew), it was dropped there, and the next run, asking the carried turn
    again, waited for the turn's whole job: its summary and entities (or an operator, had one parked)."""
    fakes = TurnsAwaitedForReal(side_step_seconds=3)
    session = f"s-{uuid.uuid4().hex[:8]}"
    first = turn(session, "First question?")
    first = first.model_copy(update={"question": first.question.model_copy(update={"require_review": True})})
    second = turn(session, "Second question?")
    async with fake_worker(env, fakes) as queue:
        # The first turn's job, as the earlier run started it: its go given, a later turn's ask heard.
        job = await env.client.start_workflow(ChatTurnWorkflow.run, first, id=first.job_id, task_queue=queue)
        await job.signal(ChatTurnWorkflow.proceed, TurnContext())
        await job.signal(ChatTurnWorkflow.follow_up_waits)

        async def held() -> bool:
            return (await job.query(ChatTurnWorkflow.progress)).status == "waiting_review"
        await eventually(held, timeout=20, what="the first answer held for review")
        # Released: the job tells that run of the session (gone here, as a run that continued as new), once.
        await job.execute_update("review", {"decision": "approve", "reviewer": "ana"})
        # The run the earlier one continued as, carrying the turn and the answer it was told.
        handle = await env.client.start_workflow(
            ChatSessionWorkflow.run, SessionState(session_id=session, pending=[first], seen=[first.job_id],
                                                  answered={first.job_id: "answer to First question?"}),
            id=session_workflow_id("default", session), task_queue=queue)
        await handle.signal(ChatSessionWorkflow.submit, second)
        assert (await turn_result(env, second.job_id)).answer == "answer to Second question?"
        await job.result()
        await handle.terminate("test over")
    first_side_steps = [c for c in fakes.calls if c.name in ("summarize_context", "extract_entities")
                        and c.arg.question == "First question?"]
    answered = next(c for c in fakes.named("generate_answer") if c.arg.question == "Second question?")
    assert first_side_steps and all(answered.started < c.finished for c in first_side_steps)
    assert answered.arg.history == [HistoryItem(question="First question?", answer="answer to First question?")]


async def test_chat_session_runs_turns_in_order_with_the_history_and_skips_a_resent_turn(env):
    fakes = Fakes(side_step_seconds=0)
    session = f"s-{uuid.uuid4().hex[:8]}"
    first, second = turn(session, "First question?"), turn(session, "Second question?")
    async with fake_worker(env, fakes) as queue:
        handle = await start_session(env, queue, first)
        await handle.signal(ChatSessionWorkflow.submit, second)
        await handle.signal(ChatSessionWorkflow.submit, first)  # the same request again
        results = [await turn_result(env, t.job_id) for t in (first, second)]
        # A third turn after them is numbered 3: the resent first one was not taken as a turn of its own.
        third = turn(session, "Third question?")
        await handle.signal(ChatSessionWorkflow.submit, third)
        results.append(await turn_result(env, third.job_id))

        async def idle() -> bool:
            return await handle.query(ChatSessionWorkflow.pending_turns) == []

        await eventually(idle, timeout=10, what="the session's queue emptying")
        await handle.terminate("test over")
    assert [r.turn for r in results] == [1, 2, 3]
    assert fakes.named("await_turn") == []
    generates = fakes.named("generate_answer")
    assert [c.arg.question for c in generates] == ["First question?", "Second question?", "Third question?"]
    # Turn 2 started only after turn 1 had finished, and answers in its context.
    first_calls = [c for c in fakes.calls if getattr(c.arg, "question", None) == "First question?"]
    second_calls = [c for c in fakes.calls if getattr(c.arg, "question", None) == "Second question?"]
    assert max(c.finished for c in first_calls) < min(c.started for c in second_calls)
    assert generates[0].arg.history == []
    assert generates[1].arg.history == [HistoryItem(question="First question?", answer="answer to First question?")]
    assert len(generates[2].arg.history) == 2


async def test_an_idle_session_ends_and_a_later_message_takes_up_what_it_left(env):
    fakes = Fakes(side_step_seconds=0)
    session = f"s-{uuid.uuid4().hex[:8]}"
    first, second, third, fourth = (turn(session, f"{n} question?") for n in ("First", "Second", "Third", "Fourth"))
    async with fake_worker(env, fakes) as queue:
        ended = await start_session(env, queue, first)
        await ended.signal(ChatSessionWorkflow.submit, second)
        left = await ended.result()  # the server skips the time the session waits: [sessions] idle
        assert (left.next_turn, left.pending, left.resumed_from) == (3, [], None)
        assert [h.question for h in left.history] == ["First question?", "Second question?"]
        assert {first.job_id, second.job_id} <= set(left.seen)
        assert fakes.named("session_left") == []  # a session started anew reads nothing

        # A later message starts it again, as the API does, from the run that ended; the same request as
        # its second turn comes again meanwhile.
        again = await start_session(env, queue, third, resumed_from=ended.result_run_id)
        await again.signal(ChatSessionWorkflow.submit, second)
        await again.signal(ChatSessionWorkflow.submit, fourth)
        results = [await turn_result(env, t.job_id) for t in (third, fourth)]
        await again.terminate("test over")
    assert [r.turn for r in results] == [3, 4]  # numbered on from the run that ended; the resend is no turn
    assert fakes.one("session_left").arg.run_id == ended.result_run_id
    generates = fakes.named("generate_answer")
    assert [c.arg.question for c in generates] == [f"{n} question?" for n in ("First", "Second", "Third", "Fourth")]
    assert [h.question for h in generates[2].arg.history] == ["First question?", "Second question?"]


async def test_a_session_started_again_after_a_run_that_did_not_end_idle_starts_anew(env):
    fakes = Fakes(side_step_seconds=0)
    session = f"s-{uuid.uuid4().hex[:8]}"
    first, second = turn(session, "First question?"), turn(session, "Second question?")
    async with fake_worker(env, fakes) as queue:
        stopped = await start_session(env, queue, first)
        await turn_result(env, first.job_id)
        await stopped.terminate("by hand")
        again = await start_session(env, queue, second, resumed_from=stopped.result_run_id)
        result = await turn_result(env, second.job_id)
        await again.terminate("test over")
    assert result.turn == 1  # it left nothing: its state went with it
    assert fakes.named("generate_answer")[-1].arg.history == []


@dataclass
class EndedRunUnreadable(Fakes):
    """What the ended run left cannot be read (its result under a codec key dropped since, say)."""

    @activity.defn(name="session_left")
    async def session_left(self, req: SessionRun) -> SessionLeft:
        self._end(self._start("session_left", req))
        raise ApplicationError("the result could not be decrypted", type="InputError", non_retryable=True)


async def test_a_session_that_cannot_read_what_its_ended_run_left_still_runs_the_turns_sent_to_it(env):
    fakes = EndedRunUnreadable(side_step_seconds=0)
    session = f"s-{uuid.uuid4().hex[:8]}"
    first = turn(session, "First question?")
    async with fake_worker(env, fakes) as queue:
        again = await start_session(env, queue, first, resumed_from="an-ended-run")
        result = await turn_result(env, first.job_id)
        await again.terminate("test over")
    assert result.turn == 1 and fakes.one("session_left").arg.run_id == "an-ended-run"


@dataclass
class FirstTurnsEntitiesFail(Fakes):
    """The first question's entities fail for good, once its answer is shown: that turn's job fails."""

    @activity.defn(name="extract_entities")
    async def extract_entities(self, req: ContextInput) -> EntitiesOutput:
        self._end(self._start("extract_entities", req))
        if req.question.startswith("First"):
            raise ApplicationError("the entities could not be read", type="InputError", non_retryable=True)
        return EntitiesOutput(entities=[], usage=Usage())


@dataclass
class FirstTurnsSummaryRunsOn(Fakes):
    """The first question's summary runs until it is cancelled (heartbeating, as the model steps do)."""

    @activity.defn(name="summarize_context")
    async def summarize_context(self, req: ContextInput) -> SummaryOutput:
        if not req.question.startswith("First"):
            return await super().summarize_context(req)
        self._start("summarize_context", req)
        while True:
            activity.heartbeat()
            await asyncio.sleep(0.1)


@pytest.mark.parametrize("ends", ["fails", "is cancelled"])
@pytest.mark.parametrize("sent", ["while the first turn runs", "once it has ended"])
async def test_an_answer_shown_before_its_turn_ended_is_in_the_next_turns_history(env, ends, sent):
    """The first turn shows its answer, then fails (its entities fail for good) or is cancelled by the person
    while its summary runs. Whether the next question was sent before (it then asked for the answer as soon as
    it was shown) or after (the failure carries the answer; a cancelled turn tells its session on its way out),
    the answer the person saw is the history it is asked in."""
    fakes = FirstTurnsEntitiesFail(side_step_seconds=0.5) if ends == "fails" else FirstTurnsSummaryRunsOn()
    session = f"s-{uuid.uuid4().hex[:8]}"
    first, second = turn(session, "First question?"), turn(session, "Second question?")
    async with fake_worker(env, fakes) as queue:
        handle = await start_session(env, queue, first)
        if sent == "while the first turn runs":
            await handle.signal(ChatSessionWorkflow.submit, second)
        if ends == "is cancelled":
            await eventually(lambda: _asyncify(fakes.named("summarize_context")), timeout=20, what="the summary")
            await env.client.get_workflow_handle(first.job_id).cancel()
        with pytest.raises(WorkflowFailureError) as ended:
            await turn_result(env, first.job_id)
        assert isinstance(ended.value.cause, CancelledError) == (ends == "is cancelled"), ended.value.cause
        if sent == "once it has ended":
            await handle.signal(ChatSessionWorkflow.submit, second)
        await turn_result(env, second.job_id)
        await handle.terminate("test over")
    asked = next(c.arg for c in fakes.named("generate_answer") if c.arg.question == "Second question?")
    assert asked.history == [HistoryItem(question="First question?", answer="answer to First question?")]



async def test_a_cancel_that_comes_with_the_next_questions_ask_waits_for_the_answer_it_sends(stack):
    """The first turn has shown its answer and runs its summary. No workflow worker runs while the session's
    ask for that answer (the next question came) and a person's cancel reach the turn: both in one workflow
    task. The answer the ask sends must land before the job ends (the server drops a signal its closed sender
    had not yet delivered), and the next question is asked with it. (On the real dev server, which drops it.)"""
    env = _on_the_dev_server(stack)
    fakes = FirstTurnsSummaryRunsOn()
    session = f"s-{uuid.uuid4().hex[:8]}"
    first, second = turn(session, "First question?"), turn(session, "Second question?")
    async with fake_worker(env, fakes, runs="activities") as queue:
        async with fake_worker(env, fakes, queue, sticky=False, runs="workflows"):
            handle = await start_session(env, queue, first)
            await eventually(lambda: _asyncify(fakes.named("summarize_context")), timeout=20, what="the summary")
        job = env.client.get_workflow_handle(first.job_id)
        await job.signal(ChatTurnWorkflow.follow_up_waits)  # what the session sends once `second` is queued
        await job.cancel()
        async with fake_worker(env, fakes, queue, runs="workflows"):
            with pytest.raises(WorkflowFailureError) as ended:
                await job.result()
            assert isinstance(ended.value.cause, CancelledError), ended.value.cause
            await handle.signal(ChatSessionWorkflow.submit, second)
            await turn_result(env, second.job_id)
            await handle.terminate("test over")
    asked = next(c.arg for c in fakes.named("generate_answer") if c.arg.question == "Second question?")
    assert asked.history == [HistoryItem(question="First question?", answer="answer to First question?")]

@dataclass
class ModelOfFewSlots(Fakes):
    """The answer step tells what a worker would: `slots` model calls at once (1: a local model). The first
    question's first summary runs for `summary_seconds` (heartbeating, as the model steps do) unless cancelled."""

    slots: int = 1
    summary_seconds: float = 30
    cancelled: list[Call] = field(default_factory=list)

    @activity.defn(name="generate_answer")
    async def generate_answer(self, req: GenerateInput) -> GenerateOutput:
        return (await super().generate_answer(req)).model_copy(update={"model_slots": self.slots})

    @activity.defn(name="summarize_context")
    async def summarize_context(self, req: ContextInput) -> SummaryOutput:
        if not req.question.startswith("First") or any(c.arg.question.startswith("First")
                                                       for c in self.named("summarize_context")):
            return await super().summarize_context(req)
        call = self._start("summarize_context", req)
        try:
            for _ in range(int(self.summary_seconds * 10)):
                activity.heartbeat()
                await asyncio.sleep(0.1)
        except asyncio.CancelledError:
            self.cancelled.append(call)
            raise
        finally:
            self._end(call)
        return SummaryOutput(summary="the long summary")


def _of(calls: list[Call], question: str) -> list[Call]:
    return [c for c in calls if c.arg.question == question]


@asynccontextmanager
async def _second_question_while_the_first_summary_runs(env, fakes: ModelOfFewSlots, *,
                                                         entities_done: bool = False, **session: Any):
    """A session's first question; once its answer is shown and its summary under way (its entities done too, if
    asked), a second question. Yields both turns. `session`: fields of the session's SessionState."""
    session_id = f"s-{uuid.uuid4().hex[:8]}"
    first, second = turn(session_id, "First question?"), turn(session_id, "Second question?")
    async with fake_worker(env, fakes) as queue:
        handle = await start_session(env, queue, first, **session)

        async def ready() -> bool:
            return bool(_of(fakes.named("summarize_context"), "First question?")) and (not entities_done or any(
                c.finished is not None for c in _of(fakes.named("extract_entities"), "First question?")))

        await eventually(ready, timeout=20, what="the first turn's side steps")
        await handle.signal(ChatSessionWorkflow.submit, second)
        yield first, second
        await handle.terminate("test over")


async def _a_follow_up_while_the_first_turns_summary_runs(env, fakes: ModelOfFewSlots):
    """Both turns' results, and the first job's steps, of a second question sent once the first turn's entities are
    done and its summary under way."""
    async with _second_question_while_the_first_summary_runs(env, fakes, entities_done=True) as (first, second):
        results = [await turn_result(env, t.job_id) for t in (first, second)]
        steps = (await env.client.get_workflow_handle(first.job_id).query(ChatTurnWorkflow.progress)).steps
    return results, {s.name: s for s in steps}


async def test_on_a_local_model_a_turns_summary_steps_aside_for_the_next_questions_answer(env):
    """One model call at a time: the first turn's summary, still running when the next question comes, would hold
    that question's answer back until it ended. It stops, the answer runs, and then the summary runs again; the
    entities, done already, are not asked again. The first turn's result has both."""
    fakes = ModelOfFewSlots(slots=1)
    (first, second), steps = await _a_follow_up_while_the_first_turns_summary_runs(env, fakes)
    [stopped, again] = _of(fakes.named("summarize_context"), "First question?")
    [answer] = _of(fakes.named("generate_answer"), "Second question?")
    assert stopped.started < answer.started and answer.finished < again.started
    await eventually(lambda: _asyncify(fakes.cancelled == [stopped]), timeout=20, what="the summary's cancel")
    assert len(_of(fakes.named("extract_entities"), "First question?")) == 1
    assert (first.summary, [e.text for e in first.entities]) == ("summary of ctx:First question?", ["Mara"])
    assert {name: s.status for name, s in steps.items()} == dict.fromkeys(
        ("retrieve_context", "generate_answer", "summarize_context", "extract_entities"), "completed"), steps
    assert steps["summarize_context"].detail == "stopped for the next question's answer, then run again"
    assert steps["extract_entities"].detail is None
    assert answer.arg.history == [HistoryItem(question="First question?", answer="answer to First question?")]
    assert second.answer == "answer to Second question?"


@dataclass
class SecondAnswerHeld(ModelOfFewSlots):
    """... and the second question's answer waits for `go_on`."""
    go_on: asyncio.Event = field(default_factory=asyncio.Event)

    @activity.defn(name="generate_answer")
    async def generate_answer(self, req: GenerateInput) -> GenerateOutput:
        if req.question.startswith("Second"):
            await self.go_on.wait()
        return await super().generate_answer(req)


async def test_a_turn_cancelled_while_its_side_steps_wait_for_the_next_answer_ends_cancelled(env):
    """The first turn's summary stepped aside and waits (the job shows it waiting, saying why) when the person
    cancels that turn: it ends cancelled, its waiting steps too, and the next question is answered as usual."""
    fakes = SecondAnswerHeld(slots=1)
    async with _second_question_while_the_first_summary_runs(env, fakes) as (first, second):
        job = env.client.get_workflow_handle(first.job_id)

        async def set_aside() -> StepState | None:
            steps = {s.name: s for s in (await job.query(ChatTurnWorkflow.progress)).steps}
            return steps["summarize_context"] if steps["summarize_context"].status == "waiting" else None

        waiting = await eventually(set_aside, timeout=20, what="the summary set aside")
        assert "next question" in waiting.detail
        await job.cancel()
        with pytest.raises(WorkflowFailureError) as ended:
            await job.result()
        assert isinstance(ended.value.cause, CancelledError), ended.value.cause
        steps = {s.name: s.status for s in (await job.query(ChatTurnWorkflow.progress)).steps}
        fakes.go_on.set()
        assert (await turn_result(env, second.job_id)).answer == "answer to Second question?"
    assert steps["summarize_context"] == "cancelled" and steps["generate_answer"] == "completed", steps
    assert len(_of(fakes.named("summarize_context"), "First question?")) == 1


@dataclass
class SecondRetrievalFails(ModelOfFewSlots):
    """... and the second question's retrieval fails for good."""

    @activity.defn(name="retrieve_context")
    async def retrieve_context(self, req: RetrieveInput) -> RetrieveOutput:
        if req.question.startswith("Second"):
            self._end(self._start("retrieve_context", req))
            raise ApplicationError("the collection is gone", type="InputError", non_retryable=True)
        return await super().retrieve_context(req)


def _told_not_timed_out(history) -> None:  # noqa: ANN001
    """The turn ran its set-aside side steps because the next turn told it, not after [sessions] step_aside."""
    signals = [e.workflow_execution_signaled_event_attributes.signal_name for e in history.events
               if e.HasField("workflow_execution_signaled_event_attributes")]
    assert "later_answer_out" in signals, signals
    assert not any(e.HasField("timer_fired_event_attributes") for e in history.events)


async def test_a_next_turn_that_fails_before_its_answer_tells_the_turn_that_stepped_aside(env):
    """The next question's turn fails before it asks the model: it tells the turn before on its way out, whose
    summary runs again then, rather than after [sessions] step_aside."""
    fakes = SecondRetrievalFails(slots=1)
    async with _second_question_while_the_first_summary_runs(env, fakes) as (first, second):
        with pytest.raises(WorkflowFailureError):
            await turn_result(env, second.job_id)
        result = await turn_result(env, first.job_id)
        history = await env.client.get_workflow_handle(first.job_id).fetch_history()
    assert result.summary == "summary of ctx:First question?"
    _told_not_timed_out(history)


async def test_a_session_that_continues_as_new_between_the_turns_still_has_the_next_turn_tell(env):
    """The session continues as new after each turn: the run that gives the second question its go is not the one
    the first turn told that its side steps step aside. That is carried, and the second turn still tells it."""
    fakes = ModelOfFewSlots(slots=1)
    async with _second_question_while_the_first_summary_runs(env, fakes, turns_per_run=1) as (first, second):
        results = [await turn_result(env, t.job_id) for t in (first, second)]
        history = await env.client.get_workflow_handle(first.job_id).fetch_history()
        session = await env.client.get_workflow_handle(session_workflow_id("default", first.session_id)).describe()
    assert session.run_id != session.raw_description.workflow_execution_info.first_run_id  # it continued as new
    assert results[0].summary == "summary of ctx:First question?"
    _told_not_timed_out(history)


async def test_on_a_hosted_model_a_turns_summary_runs_on_beside_the_next_questions_answer(env):
    """Model slots to spare: the next answer does not wait for the summary, which runs on (stopping it would pay
    for its tokens twice)."""
    fakes = ModelOfFewSlots(slots=64, summary_seconds=1.5)
    (first, _), steps = await _a_follow_up_while_the_first_turns_summary_runs(env, fakes)
    assert fakes.cancelled == [] and len(_of(fakes.named("summarize_context"), "First question?")) == 1
    assert first.summary == "the long summary"
    assert (steps["summarize_context"].status, steps["summarize_context"].detail) == ("completed", None)


# -- the tenant gate (running slots) ------------------------------------------------------------------

async def test_the_gate_grants_in_order_up_to_the_limit_and_frees_slots_of_ended_jobs(env):
    fakes = Fakes()
    queue = f"gate-{uuid.uuid4().hex[:8]}"
    policies.load(FAST_POLICIES, [policies.activity_name(a) for a in fakes.all()])
    jobs = [f"t.job-{n}-{uuid.uuid4().hex[:6]}" for n in range(6)]
    async with Worker(env.client, task_queue=queue, workflows=[TenantGateWorkflow, WaitsForSlot],
                      activities=[fakes.ended_jobs]):
        waiters = {j: await env.client.start_workflow(WaitsForSlot.run, id=j, task_queue=queue) for j in jobs}
        gate = await env.client.start_workflow(TenantGateWorkflow.run, GateState(tenant="t", limit=2),
                                               id=f"t.gate.{queue}", task_queue=queue)

        async def ask(job_id: str, limit: int | None = None, tenant: str = "t") -> None:
            await gate.signal(TenantGateWorkflow.acquire, SlotRequest(tenant=tenant, job_id=job_id, limit=limit))

        async def heard(job_id: str, count: int = 1) -> dict:
            """The latest standing the job heard, once it heard `count`."""
            async def probe() -> list[dict] | None:
                standings = await waiters[job_id].query(WaitsForSlot.standings)
                return standings if len(standings) >= count else None
            return (await eventually(probe, timeout=10, what=f"{count} answer(s) to {job_id}"))[-1]

        for job_id in jobs[:2]:
            await ask(job_id)
            assert (await heard(job_id))["granted"]
        for job_id in jobs[2:4]:
            await ask(job_id)
        assert [((s := await heard(j))["granted"], s["position"]) for j in jobs[2:4]] == [(False, 1), (False, 2)]
        await ask(jobs[2])  # asking again (a retried request) keeps the place in line
        assert (await heard(jobs[2], 2))["position"] == 1
        await ask(jobs[5], tenant="other")  # not this gate's tenant: ignored

        # A release hands the slot to the first in line.
        await gate.signal(TenantGateWorkflow.release, SlotRequest(tenant="t", job_id=jobs[0]))
        await waiters[jobs[2]].result()
        state = await gate.query(TenantGateWorkflow.slots)
        assert (state.holders, state.waiting) == ([jobs[1], jobs[2]], [jobs[3]])

        # A higher limit (the keys file changed) lets the line move at once.
        await ask(jobs[4], limit=3)
        await waiters[jobs[3]].result()
        assert (await heard(jobs[4]))["position"] == 1
        assert (await gate.query(TenantGateWorkflow.slots)).waiting == [jobs[4]]

        # A holder that ended without releasing (terminated by hand) is found by the sweep; a sweep that
        # fails is tried again one interval later, and the gate keeps its holders and line meanwhile.
        # (Time skips to each sweep while the test waits; where the first one falls is the timer's business.)
        fakes.ended.add(jobs[1])
        fakes.sweeps_fail = 1
        sweeps = len(fakes.named("ended_jobs"))
        await asyncio.wait_for(waiters[jobs[4]].result(), 60)  # granted once a sweep found jobs[1] ended
        assert fakes.sweeps_fail == 0 and len(fakes.named("ended_jobs")) >= sweeps + 2, "the failed sweep was not retried"
        state = await gate.query(TenantGateWorkflow.slots)
        assert (state.holders, state.waiting) == ([jobs[2], jobs[3], jobs[4]], [])
        # Sweeps ask only about holders, and only while someone waits.
        assert fakes.named("ended_jobs") and all(len(c.arg.job_ids) >= 2 for c in fakes.named("ended_jobs"))
        assert await waiters[jobs[5]].query(WaitsForSlot.standings) == []
        # Its current run: with time skipping to each sweep the gate may have continued as new by now.
        await env.client.get_workflow_handle(gate.id).terminate("test over")


async def test_the_gate_of_a_busy_tenant_still_continues_as_new(env):
    """A tenant's requests keep coming while the gate's history is past its bound, and each answer the
    gate sends takes 1 s to go out (SlowSignals: a busy server), so its sends always overlap. The run
    still ends within about one send's time, and what it owed jobs when it ended is told by the next
    run. Before, a run ended only once every send had been answered, and a steady stream of requests
    kept one run going until its history was full."""
    queue = f"gate-{uuid.uuid4().hex[:8]}"
    jobs = [f"t.job-{n}-{uuid.uuid4().hex[:6]}" for n in range(80)]
    async with Worker(env.client, task_queue=queue, workflows=[TenantGateWorkflow, WaitsForSlot],
                      interceptors=[SlowSignals(1.0)]):
        waiters = [await env.client.start_workflow(WaitsForSlot.run, id=j, task_queue=queue) for j in jobs]
        started = await env.client.start_workflow(TenantGateWorkflow.run,
                                                  GateState(tenant="t", limit=1000, rotate_after=40),
                                                  id=f"t.gate.{queue}", task_queue=queue)
        gate = env.client.get_workflow_handle(started.id)
        try:
            for job_id in jobs:  # one request every 0.1 s for 8 s
                await gate.signal(TenantGateWorkflow.acquire, SlotRequest(tenant="t", job_id=job_id))
                await asyncio.sleep(0.1)
            with env.auto_time_skipping_disabled():  # the answers' delays are part of the test
                for waiter in waiters:  # every job hears it runs, whichever run owed it the answer
                    assert (await waiter.result())[-1]["granted"]
            first = await env.client.get_workflow_handle(started.id, run_id=started.result_run_id).fetch_history()
            heard = sum(e.HasField("workflow_execution_signaled_event_attributes") for e in first.events)
            assert heard < len(jobs) // 2, f"the first run took {heard} of {len(jobs)} requests ({len(first.events)} events)"
            assert first.events[-1].HasField("workflow_execution_continued_as_new_event_attributes")
        finally:
            await gate.terminate("test over")


async def test_a_holder_that_asks_again_without_releasing_passes_its_slot_to_the_line(env):
    """A job's release never reached the gate (its release_slot gave up while it lent the slot to a
    person's wait), and it asks again with its next ticket: the slot it held goes to the first in line,
    and it queues behind. Before, nobody held the slot and every later job waited for ever (no sweep runs
    while a slot is free)."""
    fakes = Fakes()
    queue = f"gate-{uuid.uuid4().hex[:8]}"
    policies.load(FAST_POLICIES, [policies.activity_name(a) for a in fakes.all()])
    holder, waiter, later = (f"t.job-{n}-{uuid.uuid4().hex[:6]}" for n in range(3))
    async with Worker(env.client, task_queue=queue, workflows=[TenantGateWorkflow, WaitsForSlot],
                      activities=[fakes.ended_jobs]):
        waiters = {j: await env.client.start_workflow(WaitsForSlot.run, 2 if j == holder else 1, id=j,
                                                      task_queue=queue)
                   for j in (holder, waiter, later)}
        gate = await env.client.start_workflow(TenantGateWorkflow.run, GateState(tenant="t", limit=1),
                                               id=f"t.gate.{queue}", task_queue=queue)
        try:
            for job_id in (holder, waiter):
                await gate.signal(TenantGateWorkflow.acquire, SlotRequest(tenant="t", job_id=job_id))
            await gate.signal(TenantGateWorkflow.acquire, SlotRequest(tenant="t", job_id=holder, ticket=2))
            await waiters[waiter].result()  # granted: it was first in line
            await gate.signal(TenantGateWorkflow.acquire, SlotRequest(tenant="t", job_id=later))
            state = await gate.query(TenantGateWorkflow.slots)
            assert (state.holders, state.waiting) == ([waiter], [holder, later])
            # The line moves on as usual from there.
            await gate.signal(TenantGateWorkflow.release, SlotRequest(tenant="t", job_id=waiter))
            heard = await waiters[holder].result()  # granted, told to wait in line, granted again
            assert [(s["ticket"], s["granted"]) for s in heard] == [(1, True), (2, False), (2, True)]
        finally:
            await gate.terminate("test over")


# -- agents --------------------------------------------------------------------------------------------

async def test_an_agent_that_searches_the_same_words_again_is_told_so_and_finishes(bare_env):
    """A small model pastes what it found back in as its next query, round after round, until its budget is
    spent. A query searched before is not run again: the agent is told to search for something else or to
    finish, and does. Each plan and search step says what was called."""
    env = bare_env

    def plan(req: PlanInput) -> PlanOutput:
        if any("searched before" in o for o in req.observations):
            return finish(f"done after {len(req.observations)} observations")
        return PlanOutput(calls=[ToolCall(name="search_documents", arguments={"query": "Siege of Vicksburg."})],
                          prompt_tokens=10, completion_tokens=5)

    fakes = Fakes(plan=plan)
    async with fake_worker(env, fakes) as queue:
        job_id = f"agent-{uuid.uuid4().hex[:8]}"
        result = await env.client.execute_workflow(AgentWorkflow.run, AgentInput(goal="How did the siege end?"),
                                                   id=job_id, task_queue=queue)
        progress = await env.client.get_workflow_handle(job_id).query(AgentWorkflow.progress)
    assert (result.status, result.answer, result.llm_calls) == ("finished", "done after 2 observations", 3)
    assert [c.arg.query for c in fakes.named("search_documents")] == ["Siege of Vicksburg."]
    details = {s.name: s.detail for s in progress.steps}
    assert details["plan 1"] == details["plan 2"] == "search_documents(query='Siege of Vicksburg.')"
    assert details["search 1"] == "query: 'Siege of Vicksburg.'"


async def test_an_agent_that_only_repeats_its_search_stops_with_what_it_found(bare_env):
    """It never finishes: it stops after its planning rounds, and its answer is what its one search found,
    not what the guard told it (found by review: the answer was the guard's message three times)."""
    env = bare_env
    fakes = Fakes(plan=lambda req: PlanOutput(calls=[ToolCall(name="search_documents", arguments={"query": "tides"})],
                                              prompt_tokens=10, completion_tokens=5))
    async with fake_worker(env, fakes) as queue:
        result = await env.client.execute_workflow(AgentWorkflow.run, AgentInput(goal="When is high tide?"),
                                                   id=f"agent-{uuid.uuid4().hex[:8]}", task_queue=queue)
    assert result.status == "stopped" and len(fakes.named("search_documents")) == 1
    assert result.answer == "Stopped before finishing. What was found:\n\nfound nothing about tides"


def _times_out_while(failing: Callable[[], bool]) -> Callable[[PlanInput], PlanOutput]:
    """A plan whose model times out while `failing()`, and then finishes."""
    def plan(req: PlanInput) -> PlanOutput:
        if failing():
            raise ApplicationError("the model did not answer within the timeout", type="APITimeoutError")
        return finish("counted", tokens=15)
    return plan


async def test_a_plan_that_took_two_attempts_counts_two_model_calls(env):
    """The budget counts what may have been paid for: a first attempt that timed out after the model had
    written its reply cost a call too."""
    fakes = Fakes(plan=_times_out_while(lambda: activity.info().attempt == 1))
    async with fake_worker(env, fakes) as queue:
        result = await env.client.execute_workflow(AgentWorkflow.run, AgentInput(goal="Count the ships"),
                                                   id=f"agent-{uuid.uuid4().hex[:8]}", task_queue=queue)
    assert (result.status, result.llm_calls, result.tokens) == ("finished", 2, 15)
    assert [p.attempt for p in fakes.named("agent_plan")] == [1, 2]


async def test_a_plan_retried_by_an_operator_counts_every_attempt(env):
    """A plan that used up its attempts and was parked, then retried by an operator and answered on the
    first attempt of that round: every attempt counts against the budget, the parked round's included."""
    rounds = {"first": True}
    fakes = Fakes(plan=_times_out_while(lambda: rounds["first"]))
    async with fake_worker(env, fakes) as queue:
        handle = await env.client.start_workflow(AgentWorkflow.run, AgentInput(goal="Count the ships"),
                                                 id=f"agent-{uuid.uuid4().hex[:8]}", task_queue=queue)

        async def parked() -> bool:
            return (await handle.query(AgentWorkflow.progress)).status == "dead_lettered"
        await eventually(parked, timeout=30, what="the plan parked for an operator")
        rounds["first"] = False
        await handle.execute_update("retry", OperatorRequest(operator="ops"))
        result = await handle.result()
    attempts = policies.policy("agent_plan").retry.maximum_attempts
    assert (result.status, result.llm_calls) == ("finished", attempts + 1), result


async def test_an_edit_of_the_policy_file_does_not_change_what_a_parked_plan_cost(env, tmp_path):
    """The attempts of a plan that timed out until it parked come from its history, not from the policy file
    a replaying worker reads: the budget branches on them, and an edited file would otherwise make the agent
    fail to replay (the budget's review here, a next plan there)."""
    rounds = {"first": True}

    def plan(req: PlanInput) -> PlanOutput:
        if rounds["first"]:
            raise ApplicationError("the model did not answer within the timeout", type="APITimeoutError")
        return PlanOutput(calls=[ToolCall(name="search_documents", arguments={"query": "ships"})])

    fakes = Fakes(plan=plan)
    async with fake_worker(env, fakes) as queue:
        attempts = policies.policy("agent_plan").retry.maximum_attempts
        handle = await env.client.start_workflow(
            AgentWorkflow.run, AgentInput(goal="Count the ships", budget=Budget(max_llm_calls=attempts + 1)),
            id=f"agent-{uuid.uuid4().hex[:8]}", task_queue=queue)

        async def status_is(status: str) -> bool:
            return (await handle.query(AgentWorkflow.progress)).status == status
        await eventually(lambda: status_is("dead_lettered"), timeout=30, what="the plan parked for an operator")
        rounds["first"] = False
        await handle.execute_update("retry", OperatorRequest(operator="ops"))
        # The plan's attempts used the budget up: the agent asks a reviewer before it plans again.
        await eventually(lambda: status_is("waiting_review"), timeout=30, what="the budget's review")
        history = await handle.fetch_history()
        await handle.terminate("the test has what it needs")
    edited = tmp_path / "policies.toml"
    edited.write_text(FAST_POLICIES.read_text().replace(
        '[activities.agent_plan]\n', f'[activities.agent_plan]\nmax_attempts = {attempts - 2}\n', 1))
    policies.load(edited, worker.activity_names())
    assert policies.policy("agent_plan").retry.maximum_attempts == attempts - 2
    replayed = await Replayer(workflows=worker.WORKFLOWS, data_converter=env.client.data_converter
                              ).replay_workflow(history, raise_on_replay_failure=False)
    assert replayed.replay_failure is None, replayed.replay_failure


def _delegates_past_its_depth(req: PlanInput) -> PlanOutput:
    """A plan that delegates once (past max_depth 0: the depth guard asks a reviewer), then finishes."""
    if not req.observations and req.depth == 0:
        return PlanOutput(calls=[ToolCall(name="delegate", arguments={"subgoal": "Count the ships in the north"})])
    return finish("counted")


async def _told_to_stop_then_decided(env: WorkflowEnvironment, decide: Callable[[Any], Awaitable[Any]]):
    """An agent waits at its depth guard; with no worker running it is told to stop, then a reviewer's
    approval comes (by `decide`), so that both reach it in one workflow task. Returns what `decide` got back
    and the agent's result."""
    fakes = Fakes(plan=_delegates_past_its_depth)
    async with fake_worker(env, fakes, sticky=False) as queue:
        agent = await env.client.start_workflow(AgentWorkflow.run, AgentInput(goal="Count the ships", max_depth=0),
                                                id=f"agent-{uuid.uuid4().hex[:8]}", task_queue=queue)

        async def waits_for_a_reviewer() -> bool:
            return (await agent.query(AgentWorkflow.progress)).status == "waiting_review"
        await eventually(waits_for_a_reviewer, timeout=20, what="the agent waiting at its depth guard")
    await agent.signal("stop")
    decided = await decide(agent)
    async with fake_worker(env, fakes, queue):
        result = await agent.result()
        if isinstance(decided, asyncio.Future):
            decided = await asyncio.gather(decided, return_exceptions=True)
    return decided[0] if isinstance(decided, list) else decided, result


async def test_a_review_update_that_comes_with_a_stop_is_refused_not_ignored(env):
    """The stop and the reviewer's approval reach the agent together: the reviewer is told the review is
    withdrawn, rather than that the approval was accepted (and then find it ignored)."""
    async def approve(agent):
        update_id = f"review-{uuid.uuid4().hex[:8]}"
        sent = asyncio.ensure_future(agent.execute_update(
            "review", {"decision": "approve", "reviewer": "ana", "extra_depth": 1}, id=update_id))
        await _update_admitted(env.client, agent.id, update_id)
        return sent

    refused, result = await _told_to_stop_then_decided(env, approve)
    assert isinstance(refused, WorkflowUpdateFailedError), refused
    assert "being withdrawn" in str(refused.cause), refused.cause
    assert result.status == "stopped" and result.tree.children == []
    assert [d.decision for d in result.decisions] == [], result.decisions


async def test_a_rejection_that_comes_with_a_stop_still_counts(env):
    """A reviewer's rejection is not refused as the review is withdrawn: the agent stops either way, and the
    rejected sub-goal is the tree's to never propose again."""
    async def reject(agent):
        update_id = f"review-{uuid.uuid4().hex[:8]}"
        sent = asyncio.ensure_future(agent.execute_update("review", {"decision": "reject", "reviewer": "ana"},
                                                          id=update_id))
        await _update_admitted(env.client, agent.id, update_id)
        return sent

    ack, result = await _told_to_stop_then_decided(env, reject)
    assert (ack["accepted"], ack["decision"]) == (True, "reject"), ack
    assert result.status == "stopped" and result.rejected == ["Count the ships in the north"]


async def test_a_review_signal_that_comes_with_a_stop_is_recorded_as_rejected_input(env):
    async def approve(agent):
        await agent.signal("review", {"decision": "approve", "reviewer": "ana", "extra_depth": 1})
        return None

    _, result = await _told_to_stop_then_decided(env, approve)
    assert result.status == "stopped" and result.tree.children == []
    assert [d.decision for d in result.decisions] == [], result.decisions


def _delegates(*subgoals: str, child: Callable[[PlanInput], PlanOutput]) -> Callable[[PlanInput], PlanOutput]:
    """The root delegates `subgoals` in its first plan and finishes in its second; sub-agents plan by `child`."""
    def plan(req: PlanInput) -> PlanOutput:
        if req.depth > 0:
            return child(req)
        if not req.observations:
            return PlanOutput(calls=[ToolCall(name="delegate", arguments={"subgoal": g}) for g in subgoals])
        return finish("done", tokens=10)
    return plan


async def _status_is(handle, status: str) -> bool:
    try:
        return (await handle.query(AgentWorkflow.progress)).status == status
    except RPCError:  # not started yet
        return False


async def test_a_stop_withdraws_a_sub_agents_parked_step_and_the_tree_finishes(env):
    """A reviewer rejects one sub-agent's delegation while its sibling's plan waits for an operator: the
    sibling is told to stop, no longer waits, and the tree finishes at once with what it has. Its plan's
    attempts count against the tree's budget."""
    def child(req: PlanInput) -> PlanOutput:
        if req.goal == "the north":  # past max_depth 1: the depth guard asks a reviewer
            return PlanOutput(calls=[ToolCall(name="delegate", arguments={"subgoal": "the north-east"})])
        raise ApplicationError("the model did not answer within the timeout", type="APITimeoutError")

    fakes = Fakes(plan=_delegates("the north", "the south", child=child))
    root_id = f"agent-{uuid.uuid4().hex[:8]}"
    async with fake_worker(env, fakes) as queue:
        root = await env.client.start_workflow(AgentWorkflow.run, AgentInput(goal="Count the ships", max_depth=1),
                                               id=root_id, task_queue=queue)
        north = env.client.get_workflow_handle(agent_workflow_id(root_id, 1))
        south = env.client.get_workflow_handle(agent_workflow_id(root_id, 2))
        await eventually(lambda: _status_is(north, "waiting_review"), timeout=30, what="north at its depth guard")
        await eventually(lambda: _status_is(south, "dead_lettered"), timeout=30, what="south's plan parked")
        await north.execute_update("review", {"decision": "reject", "reviewer": "ana"})
        result = await root.result()
        south_progress = await south.query(AgentWorkflow.progress)
    assert result.status == "stopped"
    assert [(n.goal, n.status) for n in result.tree.children] == [("the north", "stopped"), ("the south", "stopped")]
    # Each says why it stopped: a reviewer's rejection, of what; a stop it was told; below it, for the root.
    assert result.stopped_reason == "a reviewer rejected something one of its sub-agents asked"
    north_why, south_why = (n.stopped_reason for n in result.tree.children)
    assert north_why.startswith("ana rejected its delegation (depth") and south_why == TOLD_TO_STOP
    assert south_progress.dead_letters == [] and south_progress.steps[0].status == "cancelled"
    south_attempts = len([c for c in fakes.named("agent_plan") if c.arg.goal == "the south"])
    assert south_attempts == policies.policy("agent_plan").retry.maximum_attempts
    assert result.llm_calls == 1 + 1 + south_attempts  # the root's plan, north's, and each of south's attempts


async def test_a_discarded_sub_agents_plan_attempts_count_against_the_tree(env):
    def child(req: PlanInput) -> PlanOutput:
        raise ApplicationError("the model did not answer within the timeout", type="APITimeoutError")

    fakes = Fakes(plan=_delegates("the north", child=child))
    root_id = f"agent-{uuid.uuid4().hex[:8]}"
    async with fake_worker(env, fakes) as queue:
        root = await env.client.start_workflow(AgentWorkflow.run, AgentInput(goal="Count the ships", max_depth=2),
                                               id=root_id, task_queue=queue)
        north = env.client.get_workflow_handle(agent_workflow_id(root_id, 1))
        await eventually(lambda: _status_is(north, "dead_lettered"), timeout=30, what="north's plan parked")
        await north.execute_update("discard", OperatorRequest(operator="ops"))
        result = await root.result()
    north_attempts = len([c for c in fakes.named("agent_plan") if c.arg.depth == 1])
    assert north_attempts == policies.policy("agent_plan").retry.maximum_attempts
    assert [(n.goal, n.status) for n in result.tree.children] == [("the north", "failed")]
    assert result.llm_calls == 2 + north_attempts  # the root's two plans, and each attempt of north's


async def test_the_same_sub_goal_twice_in_one_plan_runs_one_sub_agent(env):
    fakes = Fakes(plan=_delegates("Count the north", "count the north.", child=lambda req: finish("4 ships")))
    async with fake_worker(env, fakes) as queue:
        result = await env.client.execute_workflow(AgentWorkflow.run, AgentInput(goal="Count the ships", max_depth=2),
                                                   id=f"agent-{uuid.uuid4().hex[:8]}", task_queue=queue)
    assert [n.goal for n in result.tree.children] == ["Count the north"]
    assert [c.arg.goal for c in fakes.named("agent_plan") if c.arg.depth == 1] == ["Count the north"]


async def _update_admitted(client, workflow_id: str, update_id: str) -> None:
    """Returns once the server holds the Update (no worker has to be running)."""
    stage = UpdateWorkflowExecutionLifecycleStage.UPDATE_WORKFLOW_EXECUTION_LIFECYCLE_STAGE_ADMITTED

    async def admitted() -> bool:
        try:
            await client.workflow_service.poll_workflow_execution_update(PollWorkflowExecutionUpdateRequest(
                namespace=client.namespace, identity="test",
                update_ref=UpdateRef(workflow_execution=WorkflowExecution(workflow_id=workflow_id), update_id=update_id),
                wait_policy=WaitPolicy(lifecycle_stage=stage)), timeout=timedelta(seconds=2))
        except RPCError:
            return False
        return True
    await eventually(admitted, timeout=20, what="the server holding the review Update")


async def test_agent_that_finishes_at_once(bare_env):
    env = bare_env
    fakes = Fakes(plan=lambda req: finish(f"done: {req.goal}", tokens=15))
    async with fake_worker(env, fakes) as queue:
        job_id = f"agent-{uuid.uuid4().hex[:8]}"
        result = await env.client.execute_workflow(AgentWorkflow.run, AgentInput(goal="Count the ships", max_depth=2),
                                                   id=job_id, task_queue=queue)
        progress = await env.client.get_workflow_handle(job_id).query(AgentWorkflow.progress)
    assert isinstance(result, AgentResult)
    assert result.answer == "done: Count the ships" and result.status == "finished"
    assert (result.llm_calls, result.tokens) == (1, 15)
    assert result.tree.children == [] and result.tree.job_id == job_id and result.tree.status == "finished"
    [plan] = fakes.calls
    assert plan.name == "agent_plan" and plan.queue == queues.queue_name(queue, "llm")
    assert (plan.arg.depth, plan.arg.max_depth, plan.arg.observations) == (0, 2, [])
    assert [(s.name, s.status) for s in progress.steps] == [("plan 1", "completed")]


async def test_agent_that_delegates_once_runs_a_child_workflow(env):
    def plan(req: PlanInput) -> PlanOutput:
        if req.depth == 1:
            return finish("12 ships", tokens=20)
        if not req.observations:
            return PlanOutput(calls=[ToolCall(name="delegate", arguments={"subgoal": "Count the ships in the north"})],
                              prompt_tokens=5, completion_tokens=5)
        return finish(f"root saw: {req.observations[-1]}", tokens=30)

    fakes = Fakes(plan=plan)
    async with fake_worker(env, fakes) as queue:
        job_id = f"agent-{uuid.uuid4().hex[:8]}"
        result = await env.client.execute_workflow(AgentWorkflow.run, AgentInput(goal="Count the ships", max_depth=2),
                                                   id=job_id, task_queue=queue)
        child = await env.client.get_workflow_handle(f"{job_id}.1").describe()
    assert result.status == "finished"
    assert result.answer == "root saw: sub-agent on 'Count the ships in the north': 12 ships"
    # The tree's spend includes the child's.
    assert (result.llm_calls, result.tokens) == (3, 10 + 20 + 30)
    [node] = result.tree.children
    assert (node.goal, node.depth, node.job_id, node.status, node.answer) == (
        "Count the ships in the north", 1, f"{job_id}.1", "finished", "12 ships")
    assert child.workflow_type == "AgentWorkflow" and child.status == WorkflowExecutionStatus.COMPLETED
    assert child.parent_id == job_id
    plans = fakes.named("agent_plan")
    assert [(p.arg.goal, p.arg.depth) for p in plans] == [
        ("Count the ships", 0), ("Count the ships in the north", 1), ("Count the ships", 0)]
    assert plans[1].finished < plans[2].started


async def test_a_sub_agent_that_fails_still_counts_what_it_spent(env):
    """The child plans twice (a search, 2,000 tokens each), then fails for good: its two model calls are
    the tree's, in its budget and its result, as a finished child's are."""
    def plan(req: PlanInput) -> PlanOutput:
        if req.depth == 1:
            if len(req.observations) < 2:
                return PlanOutput(calls=[ToolCall(name="search_documents", arguments={"query": "ships"})],
                                  prompt_tokens=1990, completion_tokens=10)
            raise ApplicationError("the model wrote no call it could read, twice", type="ModelReplyError",
                                   non_retryable=True)
        if not req.observations:
            return PlanOutput(calls=[ToolCall(name="delegate", arguments={"subgoal": "Count the ships in the north"})],
                              prompt_tokens=5, completion_tokens=5)
        return finish("the north could not be counted", tokens=30)

    fakes = Fakes(plan=plan)
    async with fake_worker(env, fakes) as queue:
        result = await env.client.execute_workflow(AgentWorkflow.run, AgentInput(goal="Count the ships", max_depth=2),
                                                   id=f"agent-{uuid.uuid4().hex[:8]}", task_queue=queue)
    [node] = result.tree.children
    assert node.status == "failed" and "twice" in node.answer
    child_plans = [p for p in fakes.named("agent_plan") if p.arg.depth == 1]
    assert len(child_plans) == 3  # two that planned a search, the one that failed
    # The root's two plans and the child's three calls: the one that failed was made too (its reply came
    # back malformed), though it returned no usage.
    assert (result.llm_calls, result.tokens) == (2 + 3, 10 + 30 + 2 * 2000)


def child_delegates_then_fails(subgoal: str, grandchild_answer: str = "") -> Callable[[PlanInput], PlanOutput]:
    """Plans for a root that delegates "Count the ships in the north" and then finishes, a child that delegates
    `subgoal` once and then fails for good, and a grandchild (if it gets to run) that answers at once."""
    def plan(req: PlanInput) -> PlanOutput:
        if req.depth == 1:
            if not req.observations:
                return PlanOutput(calls=[ToolCall(name="delegate", arguments={"subgoal": subgoal})])
            raise ApplicationError("the model wrote no call it could read, twice", type="ModelReplyError",
                                   non_retryable=True)
        if req.depth == 2:
            return finish(grandchild_answer)
        if not req.observations:
            return PlanOutput(calls=[ToolCall(name="delegate", arguments={"subgoal": "Count the ships in the north"})])
        return finish("the north could not be counted")
    return plan


async def test_a_sub_agent_that_fails_shows_the_sub_agents_it_ran_in_the_tree(env):
    """The child delegates once (its sub-agent finishes), then fails for good: the root's tree shows the
    failed child with that sub-agent under it, as a finished child's tree does. It showed no children."""
    fakes = Fakes(plan=child_delegates_then_fails("Count the north harbour", "41 ships in the north harbour"))
    root_id = f"agent-{uuid.uuid4().hex[:8]}"
    async with fake_worker(env, fakes) as queue:
        result = await env.client.execute_workflow(AgentWorkflow.run, AgentInput(goal="Count the ships", max_depth=2),
                                                   id=root_id, task_queue=queue)
    [child] = result.tree.children
    assert child.status == "failed" and "twice" in child.answer
    [grandchild] = child.children
    assert (grandchild.goal, grandchild.status, grandchild.answer, grandchild.job_id) == (
        "Count the north harbour", "finished", "41 ships in the north harbour",
        agent_workflow_id(agent_workflow_id(root_id, 1), 1))


async def test_a_sub_agent_that_fails_after_a_review_keeps_the_decision_in_the_trees_record(env):
    """The child's delegation past the tree's depth waits for a reviewer, who tells it to revise; its next
    plan fails for good. Who decided what is still in the root's result (the Web UI and the CLI decide
    without the API: the job's record is the only one), as a finished child's decisions are."""
    fakes = Fakes(plan=child_delegates_then_fails("Count by hand"))
    root_id = f"agent-{uuid.uuid4().hex[:8]}"
    async with fake_worker(env, fakes) as queue:
        root = await env.client.start_workflow(AgentWorkflow.run, AgentInput(goal="Count the ships", max_depth=1),
                                               id=root_id, task_queue=queue)
        child = env.client.get_workflow_handle(agent_workflow_id(root_id, 1))
        await eventually(lambda: _status_is(child, "waiting_review"), timeout=30, what="the child at its depth guard")
        await child.execute_update("review", {"decision": "revise", "reviewer": "auditor-ann",
                                              "instructions": "count from the harbour log instead"})
        result = await root.result()
    [node] = result.tree.children
    assert node.status == "failed"
    assert [(d.decision, d.reviewer) for d in result.decisions] == [("revise", "auditor-ann")]


async def test_a_sub_agent_a_person_cancels_still_counts_what_it_spent(env):
    """The child plans a search (2,000 tokens), then a delegation past the tree's depth, and waits for a
    reviewer; a person cancels it there. Its two model calls are the tree's, as a failed child's are."""
    def plan(req: PlanInput) -> PlanOutput:
        if req.depth == 1:
            if not req.observations:
                return PlanOutput(calls=[ToolCall(name="search_documents", arguments={"query": "ships"})],
                                  prompt_tokens=1990, completion_tokens=10)
            return PlanOutput(calls=[ToolCall(name="delegate", arguments={"subgoal": "Count the ships by hand"})],
                              prompt_tokens=1990, completion_tokens=10)
        if not req.observations:
            return PlanOutput(calls=[ToolCall(name="delegate", arguments={"subgoal": "Count the ships in the north"})],
                              prompt_tokens=5, completion_tokens=5)
        return finish("the north was not counted", tokens=30)

    fakes = Fakes(plan=plan)
    root_id = f"agent-{uuid.uuid4().hex[:8]}"
    async with fake_worker(env, fakes) as queue:
        root = await env.client.start_workflow(AgentWorkflow.run, AgentInput(goal="Count the ships", max_depth=1),
                                               id=root_id, task_queue=queue)
        child = env.client.get_workflow_handle(agent_workflow_id(root_id, 1))

        async def waits_for_a_reviewer() -> bool:
            try:
                return (await child.query(AgentWorkflow.progress)).status == "waiting_review"
            except RPCError:
                return False  # not started yet
        await eventually(waits_for_a_reviewer, timeout=20, what="the sub-agent waiting at the depth guard")
        await child.cancel()
        result = await root.result()
    [node] = result.tree.children
    assert node.status == "cancelled"
    assert len([p for p in fakes.named("agent_plan") if p.arg.depth == 1]) == 2
    assert (result.llm_calls, result.tokens) == (2 + 2, 10 + 30 + 2 * 2000)


async def test_a_sub_agent_cancelled_while_it_starts_its_own_counts_what_that_one_spent(stack):
    """A person cancels sub-agent X in the workflow task that starts X's own sub-agent (held here while that
    task is open): the grandchild is cancelled, not terminated with X, and every plan made in the tree is
    counted at the root. Its plan was paid for and counted nowhere. On the real dev server."""
    tag = uuid.uuid4().hex[:8]
    grandchild_goal = f"Count the north by hand {tag}"
    tokens = {0: 10, 1: 110, 2: 1000}  # a plan's tokens by the depth of its agent (the root's last: 1000)

    def plan(req: PlanInput) -> PlanOutput:
        if req.depth < 2 and not req.observations:
            goal = "Count the north" if req.depth == 0 else grandchild_goal
            return PlanOutput(calls=[ToolCall(name="delegate", arguments={"subgoal": goal})],
                              prompt_tokens=tokens[req.depth] - 5, completion_tokens=5)
        return finish(f"counted at depth {req.depth}", tokens=1000)

    dc = stack.client.data_converter
    # The goal as the grandchild's input holds it (the plan's result, which names it first, goes by)
    held = HoldsAPayload(dc.payload_codec, marker=f'{grandchild_goal}","collection'.encode())
    holding = Client(**{**stack.client.config(), "data_converter": dataclasses.replace(dc, payload_codec=held)})
    fakes = Fakes(plan=plan)
    root_id = f"agent-{tag}"
    async with fake_worker(SimpleNamespace(client=holding), fakes) as queue:
        root = await stack.client.start_workflow(AgentWorkflow.run, AgentInput(goal="Count the ships", max_depth=3),
                                                 id=root_id, task_queue=queue)
        await asyncio.wait_for(held.reached.wait(), 30)  # X's task that starts the grandchild is open
        child_id = agent_workflow_id(root_id, 1)
        await stack.client.get_workflow_handle(child_id).cancel()
        held.go.set()
        result = await root.result()
        grandchild = stack.client.get_workflow_handle(agent_workflow_id(child_id, 1))
        assert (await grandchild.describe()).status == WorkflowExecutionStatus.CANCELED
        replayed = await Replayer(workflows=worker.WORKFLOWS, data_converter=dc).replay_workflow(
            await stack.client.get_workflow_handle(child_id).fetch_history(), raise_on_replay_failure=False)
        asked = sum(e.activity_task_scheduled_event_attributes.activity_type.name == "agent_plan"
                    for e in (await grandchild.fetch_history()).events
                    if e.HasField("activity_task_scheduled_event_attributes"))
    assert replayed.replay_failure is None, replayed.replay_failure
    plans = fakes.named("agent_plan")
    assert [node.status for node in result.tree.children] == ["cancelled"]
    # The cancel may reach the grandchild before its first workflow task has asked for its plan: then it made none.
    depths = [p.arg.depth for p in plans]
    assert depths in ([0, 1, 2, 0], [0, 1, 0]), [(p.arg.depth, p.arg.goal) for p in plans]
    # Every plan made in the tree is counted, and the grandchild's once asked for: a cancel that came before a
    # worker had it cannot tell that no model was called (the budget counts it, on the safe side).
    assert depths.count(2) <= asked <= 1
    assert result.llm_calls == depths.count(0) + depths.count(1) + asked
    # The grandchild's reply may come with its cancel (then the SDK drops it, and its tokens are not known): its
    # call counts all the same.
    assert result.tokens in ((10 + 110 + 1000, 10 + 110 + 1000 + 1000) if 2 in depths else (10 + 110 + 1000,))


async def test_a_decision_that_comes_with_the_reviews_timeout_stands(env):
    """No worker runs while the review's timeout passes and a reviewer approves: both reach the agent in one
    workflow task. The approval it was sent stands; the timeout's rejection does not replace it."""
    def plan(req: PlanInput) -> PlanOutput:
        if not req.observations and req.depth == 0:
            return PlanOutput(calls=[ToolCall(name="delegate", arguments={"subgoal": "Count the ships in the north"})],
                              prompt_tokens=5, completion_tokens=5)
        return finish("counted")

    fakes = Fakes(plan=plan)
    async with fake_worker(env, fakes, sticky=False) as queue:
        agent = await env.client.start_workflow(
            AgentWorkflow.run, AgentInput(goal="Count the ships", max_depth=0, review_timeout_seconds=6),
            id=f"agent-{uuid.uuid4().hex[:8]}", task_queue=queue)

        async def waits_for_a_reviewer() -> bool:
            return (await agent.query(AgentWorkflow.progress)).status == "waiting_review"
        await eventually(waits_for_a_reviewer, timeout=20, what="the agent waiting at the depth guard")

    # The review's timer fires, in real time, with no worker to see it: 6 s leaves a slow worker time to shut
    # down first (with 2 s, one still shutting down could see the timeout itself). The shared test server's
    # clock cannot be skipped here: other tests' workflows hold it.
    async def timed_out() -> bool:
        return any([e.event_type == EventType.EVENT_TYPE_TIMER_FIRED async for e in agent.fetch_history_events()])
    await eventually(timed_out, timeout=20, what="the review's timer fired")
    await agent.signal("review", {"decision": "approve", "reviewer": "ana", "extra_depth": 1})
    async with fake_worker(env, fakes, queue):
        result = await agent.result()
    [decision] = result.decisions
    assert (decision.decision, decision.reviewer) == ("approve", "ana"), decision


@workflow.defn(sandboxed=False)
class HoldsASlot:
    """A job reduced to its running slot."""

    def __init__(self) -> None:
        self.slot = RunningSlot(JobEvents(), lambda: None)

    @workflow.signal
    def slot_update(self, standing: SlotGrant) -> None:
        self.slot.heard(standing)

    @workflow.run
    async def run(self) -> bool:
        await self.slot.acquire(takes_slot=True)
        return self.slot.held


@activity.defn(name="acquire_slot")
async def answered_out_of_order(req: SlotRequest) -> None:
    """The gate's two answers to one request, arriving in the wrong order: the grant, then the "wait in
    line" it sent first (each is a signal of its own, which the server may deliver in either order)."""
    job = activity.client().get_workflow_handle(req.job_id)
    await job.signal("slot_update", SlotGrant(ticket=req.ticket, granted=True, running=2, limit=2))
    await job.signal("slot_update", SlotGrant(ticket=req.ticket, granted=False, running=2, limit=2, position=1))


async def test_a_grant_is_not_undone_by_a_wait_in_line_that_arrives_after_it(env):
    queue = f"slot-order-{uuid.uuid4().hex[:8]}"
    policies.load(FAST_POLICIES, [policies.activity_name(a) for a in Fakes().all()])
    async with Worker(env.client, task_queue=queue, workflows=[HoldsASlot], activities=[answered_out_of_order]):
        held = env.client.execute_workflow(
            HoldsASlot.run, id=f"t.{queue}", task_queue=queue,
            search_attributes=TypedSearchAttributes([SearchAttributePair(sa.TENANT, "t")]))
        assert await asyncio.wait_for(held, 30) is True


@workflow.defn(sandboxed=False)
class ParksTwoCalls:
    """Two calls of one step (two batches) parked, reduced to their dead letters."""

    def __init__(self) -> None:
        self.letters = DeadLetters(JobEvents(), lambda: None)
        self.calls: list[asyncio.Task] = []

    @workflow.signal
    def park_one(self) -> None:
        self.calls.append(asyncio.ensure_future(self.letters.park("embed_chunks", attempts=4, reason="down",
                                                                  error_type="TransientError")))

    @workflow.signal
    def retry_and_park_another(self) -> None:
        """The operator's retry, and the second batch's last failure, in one activation."""
        self.letters.retry(OperatorRequest(operator="ops"))
        self.park_one()

    @workflow.query
    def parked(self) -> list[str]:
        return [letter.step for letter in self.letters.parked.values()]

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: len(self.calls) == 2 and all(c.done() for c in self.calls))


async def test_a_parked_batch_that_goes_on_leaves_its_sibling_parked_beside_it_listed(env):
    """The first batch goes on with the operator's retry; the second, parked in the same moment, stays listed
    (it was taken off with the first, and waited unseen: a retry was refused as 'not dead_lettered')."""
    queue = f"parked-{uuid.uuid4().hex[:8]}"
    policies.load(FAST_POLICIES, [policies.activity_name(a) for a in Fakes().all()])
    async with Worker(env.client, task_queue=queue, workflows=[ParksTwoCalls]):
        handle = await env.client.start_workflow(ParksTwoCalls.run, id=f"t.{queue}", task_queue=queue)
        await handle.signal(ParksTwoCalls.park_one)
        await eventually(lambda: handle.query(ParksTwoCalls.parked), what="the first batch parked")
        await handle.signal(ParksTwoCalls.retry_and_park_another)

        async def one_parked() -> list[str] | None:
            parked = await handle.query(ParksTwoCalls.parked)
            return parked if len(parked) == 1 else None

        assert await eventually(one_parked, what="the second batch still listed") == ["embed_chunks"]
        await handle.terminate()


async def test_a_step_coroutine_closed_by_the_garbage_collector_runs_no_workflow_code():
    """Once a worker lets go of a workflow, its coroutines may be closed (GeneratorExit) on any thread, another
    workflow's included. Steps run together caught that as a failure and stopped their siblings, awaiting them:
    "coroutine ignored GeneratorExit", seen after a test's worker shut down with a held turn in its cache."""
    from workflows.job import JobWorkflow

    pending = asyncio.get_running_loop().create_future()
    together = JobWorkflow.together(pending)
    together.send(None)  # waiting on its step
    together.close()  # raised RuntimeError when the coroutine ran more code
    assert not pending.cancelled()
    pending.cancel()


async def test_a_slot_lent_once_work_ends_lets_its_coroutine_close_without_waiting(monkeypatch):
    """A chat turn whose answer waits for a reviewer while its summary runs lends its slot once the summary ends.
    Closed by the garbage collector in that wait (its worker let go of it), the lending awaited its helper
    first: "coroutine ignored GeneratorExit", printed by every test run."""
    from workflows.slot import RunningSlot

    forever = asyncio.get_running_loop().create_future()

    async def wait_condition(predicate, **kwargs) -> None:
        await forever

    monkeypatch.setattr(workflow, "wait_condition", wait_condition)
    slot = RunningSlot(events=None, on_change=lambda: None)
    before = asyncio.all_tasks()
    pending = asyncio.get_running_loop().create_future()

    async def review() -> None:
        async with slot._lent_while_idle(idle=lambda: False):
            await pending

    held = review()
    held.send(None)  # the reviewer's wait, the lending helper started beside it
    [helper] = asyncio.all_tasks() - before
    try:
        held.close()  # raised RuntimeError when the coroutine awaited the helper
    finally:
        helper.cancel()
        pending.cancel()


async def test_a_person_wait_closed_by_the_garbage_collector_tells_its_parent_nothing(monkeypatch):
    """A sub-agent waiting for a person tells its parent job so (a signal); closed by the garbage collector in
    that wait, it ran workflow code from the closing coroutine, on whatever thread closed it, to tell the
    parent it no longer waits."""
    from workflows.slot import RunningSlot
    from workflows.waits import PersonWaits

    told: list[bool] = []

    async def tell(parent_id: str, news) -> None:
        told.append(news.waiting)

    monkeypatch.setattr(workflow, "patched", lambda patch_id: True)
    monkeypatch.setattr(workflow, "info", lambda: SimpleNamespace(workflow_id="agent-1.sub",
                                                                  parent=SimpleNamespace(workflow_id="agent-1")))
    monkeypatch.setattr(PersonWaits, "_tell", staticmethod(tell))
    waits = PersonWaits(RunningSlot(events=None, on_change=lambda: None), within_parent=lambda: True)
    pending = asyncio.get_running_loop().create_future()

    async def review() -> None:
        async with waits.own():
            await pending

    held = review()
    held.send(None)  # the person's wait begins: the parent is told
    await asyncio.sleep(0)
    assert told == [True]
    held.close()
    await asyncio.sleep(0)
    assert told == [True]
    pending.cancel()


async def test_a_job_closed_by_the_garbage_collector_gives_back_no_slot_from_the_closed_coroutine(monkeypatch):
    """A running job evicted from its worker's cache: its coroutine, closed, gave back its running slot (a wait and
    a local activity) from the closing coroutine: "coroutine ignored GeneratorExit". The gate's sweep frees it."""
    from workflows.job import JobWorkflow

    monkeypatch.setattr(workflow, "patched", lambda patch_id: True)
    forever = asyncio.get_running_loop().create_future()
    released: list[bool] = []

    async def acquire(**kwargs) -> None:
        await forever

    async def release() -> None:
        released.append(True)
        await forever

    job = JobWorkflow.__new__(JobWorkflow)
    job.events = SimpleNamespace(hold_steps=False, emit=lambda *args: None)
    job.slot = SimpleNamespace(acquire=acquire, release=release)
    job.SLOT_BEFORE_WORK = False
    job.takes_slot = lambda: True
    before = asyncio.all_tasks()
    pending = asyncio.get_running_loop().create_future()
    running = job.run_job(lambda: pending, accepted={})
    running.send(None)  # at work, its slot asked for beside it
    try:
        assert released == []
        running.close()  # raised RuntimeError once the release waited
        assert released == []
    finally:
        for task in asyncio.all_tasks() - before:
            task.cancel()
        pending.cancel()


async def test_a_step_closed_by_the_garbage_collector_tells_no_parent_it_stopped(monkeypatch):
    """A step of a sub-agent counts as its work running; ended, the job tells its parent whether it now waits for a
    person (a signal). Closed by the garbage collector, the step told it from the closing coroutine."""
    from activities.chat import ChatActivities
    from workflows.job import JobWorkflow

    pending = asyncio.get_running_loop().create_future()
    monkeypatch.setattr(policies, "execute", lambda activity, arg, **options: pending)

    async def take_back() -> None:
        pass

    running: list[int] = []
    job = JobWorkflow.__new__(JobWorkflow)
    job.slot = SimpleNamespace(take_back=take_back)
    job._calls_running = 0
    job.waits = SimpleNamespace(recheck=lambda: running.append(job._calls_running))
    job.steps = SimpleNamespace(scheduled=lambda step, name: None)
    calling = job.call(ChatActivities.summarize_context, None, step="summarize")
    calling.send(None)
    assert running == [1]
    calling.close()
    assert running == [1]
    pending.cancel()


async def test_a_held_answer_closed_by_the_garbage_collector_writes_no_memo(monkeypatch):
    """A held answer's turn marks its memo "review pending" and clears it once decided. Closed by the garbage collector
    while the reviewer decides, it cleared the memo from the closing coroutine: on whatever workflow the closing
    thread was running, or failing there."""
    from workflows.chat import ChatTurnWorkflow

    forever = asyncio.get_running_loop().create_future()
    memos: list[dict] = []

    async def wait(tasks, **kwargs) -> None:
        await forever

    async def beside(work):
        return forever

    async def review_decision(turn, answer):
        await forever

    monkeypatch.setattr(workflow, "patched", lambda patch_id: True)
    monkeypatch.setattr(workflow, "wait", wait)
    monkeypatch.setattr(workflow, "upsert_memo", memos.append)
    turn = ChatTurnWorkflow.__new__(ChatTurnWorkflow)
    turn.beside = beside
    turn._review_decision = review_decision
    before = asyncio.all_tasks()
    reviewed = turn._reviewed_beside_side_steps(None, SimpleNamespace(answer="Ada."), None, None)
    reviewed.send(None)  # the reviewer decides
    try:
        assert len(memos) == 1
        reviewed.close()
        assert len(memos) == 1
    finally:
        for task in asyncio.all_tasks() - before:
            task.cancel()
