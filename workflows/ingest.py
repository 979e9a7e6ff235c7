"""Ingestion DAG.

IngestWorkflow (one job per upload request)
  fan out: one IngestDocumentWorkflow child per file, in parallel
  fan in:  each document's outcome; one bad file does not fail the others

IngestDocumentWorkflow (one per document id = collection + content hash)
  extract_text -> chunk_text -> [embed_chunks -> index_chunks] per batch, batches in parallel
  -> prune_stale_chunks
"""

from __future__ import annotations

import asyncio

from temporalio import workflow
from temporalio.contrib.workflow_streams import WorkflowStream
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDReusePolicy
from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError, WorkflowAlreadyStartedError

with workflow.unsafe.imports_passed_through():
    from activities.models import (
        AwaitDocumentInput, ChunkInput, ChunkOutput, EmbedInput, EmbedOutput, ExtractInput, ExtractOutput,
        IndexInput, IndexOutput, PruneInput, PruneOutput,
    )
    from temporal import policies
    from temporal import search_attributes as sa
    from workflows.models import (
        DocumentInput, DocumentOutcome, IngestInput, IngestResult, JobProgress, document_workflow_id,
    )
    from workflows.steps import OperatorHandlers, Steps, failure_reason, failure_type


@workflow.defn
class IngestDocumentWorkflow(OperatorHandlers):
    def __init__(self) -> None:
        self.stream = WorkflowStream()
        self.steps = Steps(self.stream, ["extract_text", "chunk_text", "embed_chunks", "index_chunks"])

    @workflow.query
    def progress(self) -> JobProgress:
        return self.steps.view()

    @workflow.run
    async def run(self, doc: DocumentInput) -> DocumentOutcome:
        self.steps.emit("ragline.job.accepted", {"document_id": doc.document_id, "filename": doc.filename})
        try:
            extracted = await self.steps.run("extract_text", lambda: workflow.execute_activity(
                "extract_text", ExtractInput(document_id=doc.document_id, blob_ref=doc.blob_ref,
                                             filename=doc.filename, kind=doc.kind, password=doc.password),
                result_type=ExtractOutput, **policies.options("extract_text")))
            chunked = await self.steps.run("chunk_text", lambda: workflow.execute_activity(
                "chunk_text", ChunkInput(document_id=doc.document_id, pages_ref=extracted.pages_ref),
                result_type=ChunkOutput, **policies.options("chunk_text")))
            await self._embed_and_index(doc, chunked)
            await self.steps.call("prune_stale_chunks", lambda: workflow.execute_activity(
                "prune_stale_chunks", PruneInput(document_id=doc.document_id, collection=doc.collection,
                                                 keep_chunks=chunked.chunks),
                result_type=PruneOutput, **policies.options("prune_stale_chunks")))
        except (ActivityError, ApplicationError) as exc:
            self.steps.skip_pending()
            reason = failure_reason(exc)
            await self.steps.finish("ragline.job.failed", {"error": reason})
            # The step already exhausted its retry policy (or failed non-retryably): fail the job with
            # the reason a person can act on, and do not retry the workflow itself.
            raise ApplicationError(reason, type=failure_type(exc), non_retryable=True) from exc
        workflow.upsert_search_attributes([sa.CHUNKS.value_set(chunked.chunks), sa.PAGES.value_set(extracted.pages)])
        outcome = DocumentOutcome(document_id=doc.document_id, filename=doc.filename, status="indexed",
                                  job_id=workflow.info().workflow_id, pages=extracted.pages, chunks=chunked.chunks)
        await self.steps.finish("ragline.job.completed", outcome.model_dump(mode="json"))
        return outcome

    async def _embed_and_index(self, doc: DocumentInput, chunked: ChunkOutput) -> None:
        size = max(1, chunked.batch_size)
        batches = [(start, min(start + size, chunked.chunks)) for start in range(0, chunked.chunks, size)]
        gate = asyncio.Semaphore(max(1, chunked.parallelism))
        done = {"embed_chunks": 0, "index_chunks": 0}

        def advance(step: str, attempt: int) -> None:
            done[step] += 1
            self.steps.progress(step, attempts=attempt, detail=f"{done[step]}/{len(batches)} batches")

        async def one_batch(start: int, end: int) -> None:
            async with gate:
                self.steps.start("embed_chunks", detail=f"{done['embed_chunks']}/{len(batches)} batches")
                embedded = await self.steps.call("embed_chunks", lambda: workflow.execute_activity(
                    "embed_chunks", EmbedInput(chunks_ref=chunked.chunks_ref, start=start, end=end),
                    result_type=EmbedOutput, **policies.options("embed_chunks")))
                advance("embed_chunks", embedded.attempt)
                self.steps.start("index_chunks", detail=f"{done['index_chunks']}/{len(batches)} batches")
                indexed = await self.steps.call("index_chunks", lambda: workflow.execute_activity(
                    "index_chunks", IndexInput(document_id=doc.document_id, collection=doc.collection,
                                               filename=doc.filename, chunks_ref=chunked.chunks_ref,
                                               vectors_ref=embedded.vectors_ref, start=start, end=end),
                    result_type=IndexOutput, **policies.options("index_chunks")))
                advance("index_chunks", indexed.attempt)

        await asyncio.gather(*(one_batch(s, e) for s, e in batches))
        for step in ("embed_chunks", "index_chunks"):
            self.steps.complete(step)


@workflow.defn
class IngestWorkflow(OperatorHandlers):
    def __init__(self) -> None:
        self.stream = WorkflowStream()
        self.steps = Steps(self.stream, [])

    @workflow.query
    def progress(self) -> JobProgress:
        return self.steps.view()

    @workflow.run
    async def run(self, job: IngestInput) -> IngestResult:
        self.steps.emit("ragline.job.accepted", {"collection": job.collection,
                                                 "documents": [d.filename for d in job.documents]})
        self.steps.set_status("running")
        outcomes = await asyncio.gather(*(self._ingest_document(doc) for doc in job.documents))
        indexed = sum(o.status == "indexed" for o in outcomes)
        result = IngestResult(collection=job.collection, indexed=indexed, failed=len(outcomes) - indexed,
                              documents=list(outcomes))
        if indexed == 0:
            reasons = "; ".join(f"{o.filename}: {o.error}" for o in outcomes)
            await self.steps.finish("ragline.job.failed", {"error": reasons})
            raise ApplicationError(f"no document could be ingested: {reasons}", result.model_dump(mode="json"),
                                   type="InputError", non_retryable=True)
        await self.steps.finish("ragline.job.completed", result.model_dump(mode="json"))
        return result

    async def _ingest_document(self, doc: DocumentInput) -> DocumentOutcome:
        step = f"document:{doc.filename}"
        child_id = document_workflow_id(doc.document_id)
        self.steps.start(step, detail=child_id)
        try:
            outcome = await workflow.execute_child_workflow(
                IngestDocumentWorkflow.run, doc, id=child_id,
                # A document that failed (e.g. wrong password) may be tried again; an indexed one is reused.
                id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY,
                parent_close_policy=workflow.ParentClosePolicy.ABANDON,
                search_attributes=TypedSearchAttributes([
                    SearchAttributePair(sa.JOB_KIND, "ingest_document"),
                    SearchAttributePair(sa.JOB_STATUS, "queued"),
                    SearchAttributePair(sa.COLLECTION, doc.collection),
                    SearchAttributePair(sa.FILENAME, doc.filename[:256]),
                    SearchAttributePair(sa.DOCUMENT_ID, doc.document_id),
                ]))
        except WorkflowAlreadyStartedError:
            # Same bytes in the same collection: indexed already, or being indexed by another job.
            outcome = await self.steps.call("await_document", lambda: workflow.execute_activity(
                "await_document", AwaitDocumentInput(workflow_id=child_id), result_type=DocumentOutcome,
                **policies.options("await_document")))
            outcome.filename = outcome.filename or doc.filename
        except ChildWorkflowError as exc:
            outcome = DocumentOutcome.failed_from(child_id, failure_reason(exc), doc.filename)
        if outcome.status == "indexed":
            self.steps.complete(step, detail=f"{outcome.chunks} chunks from {outcome.pages} pages")
        else:
            self.steps.fail(step, outcome.error or "failed")
        return outcome
