"""Ingestion DAG.

IngestWorkflow (one job per upload request)
  fan out: one IngestDocumentWorkflow child per file, in parallel (a document another upload indexed:
           its outcome, awaited; unless a removal took it out since, then a new child)
  fan in:  each document's outcome; one bad file does not fail the others

IngestDocumentWorkflow (one per document id = collection + content hash)
  extract_text -> chunk_text -> [embed_chunks -> index_chunks (pending: nobody finds them)] per batch,
  batches in parallel -> prune_stale_chunks (an older chunking's chunks go, the new ones become searchable)
  on failure or cancel after indexing began: the batches in flight stop and end, then
  remove_document_chunks (undo the batches indexed)
"""

from __future__ import annotations

import asyncio

from temporalio import workflow
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDReusePolicy
from temporalio.exceptions import (
    ActivityError, ApplicationError, ChildWorkflowError, WorkflowAlreadyStartedError, is_cancelled_exception,
)
from temporalio.workflow import ActivityCancellationType

with workflow.unsafe.imports_passed_through():
    from activities.ingest import IngestActivities
    from activities.jobs import JobActivities
    from models.ingest import (
        CANCELLED, CANCELLED_WITH_ITS_UPLOAD, AwaitDocumentInput, ChunkInput, ChunkOutput, DocumentInput,
        DocumentOutcome, EmbedInput, ExtractInput, IndexInput, IngestInput, IngestResult, PruneInput, PruneOutput,
        RemoveInput, document_workflow_id, removal_workflow_id,
    )
    from ragline import metrics
    from ragline.text import PASSWORD_REQUIRED, WRONG_PASSWORD
    from temporal import policies
    from temporal import search_attributes as sa
    from workflows.children import started_child
    from workflows.failures import failure_reason, failure_type
    from workflows.job import JobWorkflow

EMBED = policies.activity_name(IngestActivities.embed_chunks)
# Histories of documents that failed before this replay without the undo.
UNDO_PATCH = "failed-document-removes-its-chunks"
# ... and without waiting for the batches still in flight before it.
SETTLE_PATCH = "document-batches-settle-before-undo"
INDEX = policies.activity_name(IngestActivities.index_chunks)
# An upload that finds its document indexed by an earlier job asks whether a removal (DELETE) took it out
# since, and then ingests it anew. Earlier uploads took the earlier outcome as it was.
REMOVED_PATCH = "upload-after-removal-ingests-anew"
# The documents list shows a document's pages once they are extracted, not only once it is indexed
# (a document parked for an operator showed none). Earlier histories set them at the end only.
PAGES_PATCH = "document-pages-shown-after-extraction"
# A cancel that reaches the document during its last step (the publish, the commit of its chunks) waits
# for that step: published, the document is indexed and the job completes. Before, the undo ran beside the
# publish, found nothing pending and the job ended cancelled with every chunk of it found by searches.
PUBLISH_SETTLES_PATCH = "document-publish-settles-before-a-cancel"
# ... and a cancel that reached the job in the workflow task bringing the publish's result (which the SDK then
# drops) leaves the document indexed when the undo finds its chunks published. Before, the job ended cancelled
# with its document found by searches.
PUBLISH_LANDED_PATCH = "document-published-as-the-cancel-came-is-indexed"
# An upload with a password that waited for the document's run another upload started, and saw it fail on
# that upload's password (a wrong one, or none), runs the document once itself, with its own.
OWN_PASSWORD_PATCH = "upload-tries-its-own-password"
# An upload that waited for the document's run another upload started, and saw it cancelled with that
# upload, runs the document once itself. Before, it took that outcome as its own: a person cancelling
# upload A failed upload B's copy of the file.
OWN_RUN_PATCH = "upload-runs-a-document-another-upload-failed"
# A cancel that reaches an upload while its document's job is being started cancels that job once started
# (workflows/children.py). Before, the document was embedded and indexed for a cancelled upload.
CANCEL_AFTER_START_PATCH = "upload-cancel-waits-for-its-documents-start"
# A document removed (DELETE) again while the upload ran is no fault of its file: its type says `Removed` (the
# same file may be sent again). Before, it had none, and the upload of it alone failed as an InputError.
REMOVED_AGAIN_PATCH = "upload-removed-again-is-not-the-files-fault"


@workflow.defn
class IngestDocumentWorkflow(JobWorkflow):
    PLANNED = (IngestActivities.extract_text, IngestActivities.chunk_text, IngestActivities.embed_chunks,
               IngestActivities.index_chunks, IngestActivities.prune_stale_chunks)

    @workflow.run
    async def run(self, doc: DocumentInput) -> DocumentOutcome:
        return await self.run_job(lambda: self._ingest(doc),
                                  accepted={"document_id": doc.document_id, "filename": doc.filename})

    async def _ingest(self, doc: DocumentInput) -> DocumentOutcome:
        extracted = await self.step(IngestActivities.extract_text, ExtractInput(
            document_id=doc.document_id, blob_ref=doc.blob_ref, filename=doc.filename, kind=doc.kind,
            password=doc.password, max_pages=doc.max_pages))
        if workflow.patched(PAGES_PATCH):
            self.upsert_attributes(sa.PAGES.value_set(extracted.pages))
        chunked = await self.step(IngestActivities.chunk_text, ChunkInput(
            document_id=doc.document_id, pages_ref=extracted.pages_ref))
        publishing = False
        try:
            await self._embed_and_index(doc, chunked)
            publish_options = {"cancellation_type": ActivityCancellationType.WAIT_CANCELLATION_COMPLETED} \
                if workflow.patched(PUBLISH_SETTLES_PATCH) else {}
            publishing = True
            await self.step(IngestActivities.prune_stale_chunks, PruneInput(
                tenant=doc.tenant, document_id=doc.document_id, collection=doc.collection, keep_chunks=chunked.chunks),
                **publish_options)
        except (Exception, asyncio.CancelledError) as exc:
            # Batches indexed before the failure would be found once published: they go. Chunks an earlier
            # run published (the same bytes, indexed longer ago than the retention) stay found.
            if not workflow.patched(UNDO_PATCH):
                raise
            undone = await self._remove_chunks(doc)
            cancelled = isinstance(exc, asyncio.CancelledError) or is_cancelled_exception(exc)
            if not (publishing and cancelled and _published(undone, chunked.chunks)
                    and workflow.patched(PUBLISH_LANDED_PATCH)):
                raise
            # The publish landed as the cancel came (in one workflow task the SDK raises the cancel in place of
            # the publish's result): the store says the document is indexed, and so does its job.
            self.steps.complete(policies.activity_name(IngestActivities.prune_stale_chunks),
                                detail="published as the cancel came")
        self.upsert_attributes(sa.CHUNKS.value_set(chunked.chunks), sa.PAGES.value_set(extracted.pages))
        metrics.document_ingested(workflow.metric_meter(), extracted.pages, chunked.chunks,
                                  doc.collection if doc.metrics_collection_label else None)
        return DocumentOutcome(document_id=doc.document_id, filename=doc.filename, status="indexed",
                               job_id=workflow.info().workflow_id, pages=extracted.pages, chunks=chunked.chunks)

    async def _remove_chunks(self, doc: DocumentInput) -> PruneOutput | None:
        """The document's pending chunks removed: what was removed and what stays found (None: not known)."""
        try:
            return await policies.execute(IngestActivities.remove_document_chunks, RemoveInput(
                tenant=doc.tenant, document_id=doc.document_id, collection=doc.collection, pending_only=True))
        except ActivityError as exc:  # the job's own failure is what it ends with; this one is logged
            workflow.logger.warning("chunks of a failed document not removed: %s", failure_reason(exc))
            return None

    async def _embed_and_index(self, doc: DocumentInput, chunked: ChunkOutput) -> None:
        """embed_chunks -> index_chunks per batch; `parallelism` batches in flight; one step each in the view."""
        # On a failure or a cancel, the batches still in flight end before the undo runs: a write landing
        # after it would leave chunks of a failed document searchable. index_chunks does not heartbeat,
        # so a cancel reaches it only when it ends: the job waits for that end, not for the request.
        settle = workflow.patched(SETTLE_PATCH)
        index_options = {"cancellation_type": ActivityCancellationType.WAIT_CANCELLATION_COMPLETED} if settle else {}
        size = max(1, chunked.batch_size)
        batches = [(start, min(start + size, chunked.chunks)) for start in range(0, chunked.chunks, size)]
        gate = asyncio.Semaphore(max(1, chunked.parallelism))
        done = {EMBED: 0, INDEX: 0}

        def advance(step: str, attempt: int) -> None:
            done[step] += 1
            self.steps.progress(step, attempts=attempt, detail=f"{done[step]}/{len(batches)} batches")

        halted = False  # (with settle) a batch failed for good: the batches still waiting do not begin

        async def one_batch(start: int, end: int) -> None:
            nonlocal halted
            async with gate:
                if halted:
                    return
                try:
                    self.steps.start(EMBED, detail=f"{done[EMBED]}/{len(batches)} batches")
                    embedded = await self.call(IngestActivities.embed_chunks, EmbedInput(
                        chunks_ref=chunked.chunks_ref, start=start, end=end), step=EMBED)
                    advance(EMBED, embedded.attempt)
                    self.steps.start(INDEX, detail=f"{done[INDEX]}/{len(batches)} batches")
                    indexed = await self.call(IngestActivities.index_chunks, IndexInput(
                        tenant=doc.tenant, document_id=doc.document_id, collection=doc.collection,
                        filename=doc.filename, chunks_ref=chunked.chunks_ref, vectors_ref=embedded.vectors_ref,
                        start=start, end=end, max_documents=doc.max_documents), step=INDEX, **index_options)
                    advance(INDEX, indexed.attempt)
                except Exception:
                    halted = settle  # set before the gate lets the next batch in
                    raise

        if not settle:
            await asyncio.gather(*(one_batch(s, e) for s, e in batches))
        else:
            running = [asyncio.create_task(one_batch(s, e)) for s, e in batches]
            try:
                await asyncio.gather(*running)
            except (Exception, asyncio.CancelledError):
                # A batch failed for good, or the job was cancelled (gather gives up at the first batch
                # cancelled): every batch stops, and ends, before the undo.
                for task in running:
                    task.cancel()
                await asyncio.gather(*running, return_exceptions=True)
                self.steps.cancel_running(EMBED, INDEX)  # the batches that had not ended never will
                raise
        for step in (EMBED, INDEX):
            self.steps.complete(step)


def _upload_failure_type(outcomes: list[DocumentOutcome]) -> str:
    """Why no document of an upload was indexed, as a type a client can act on: `Cancelled` when a person
    cancelled them all (the files were not at fault); the documents' own type when they share one (InputError:
    the files themselves, never to be sent again as they are; Discarded or DeadLetterExpired: an outage parked
    them and it ended there, so the same files may be sent again; Removed: a DELETE took the document out again
    while the upload ran); `DocumentsFailed` when they differ."""
    if all(o.error in _CANCELLED for o in outcomes):
        return "Cancelled"
    kinds = {o.error_type or "InputError" for o in outcomes if o.error not in _CANCELLED}
    return kinds.pop() if len(kinds) == 1 else "DocumentsFailed"


@workflow.defn
class IngestWorkflow(JobWorkflow):
    @workflow.run
    async def run(self, job: IngestInput) -> IngestResult:
        return await self.run_job(lambda: self._ingest(job), accepted={
            "collection": job.collection, "documents": [d.filename for d in job.documents]})

    async def _ingest(self, job: IngestInput) -> IngestResult:
        self.begin()
        outcomes = await asyncio.gather(*(self._ingest_document(doc, step)
                                          for doc, step in zip(job.documents, _step_names(job.documents))))
        indexed = sum(o.status == "indexed" for o in outcomes)
        result = IngestResult(collection=job.collection, indexed=indexed, failed=len(outcomes) - indexed,
                              documents=list(outcomes))
        if indexed == 0:
            reasons = "; ".join(f"{o.filename}: {o.error}" for o in outcomes)
            kind = _upload_failure_type(outcomes)
            raise ApplicationError(f"no document could be ingested: {reasons}", result.model_dump(mode="json"),
                                   type=kind, non_retryable=True)
        return result

    async def _ingest_document(self, doc: DocumentInput, step: str) -> DocumentOutcome:
        child_id = document_workflow_id(doc.tenant, doc.document_id)
        self.steps.start(step, detail=child_id)
        # A document that failed (e.g. wrong password) may be tried again; an indexed one is reused.
        outcome = await self._document_run(doc, step, WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY)
        if outcome.status == "removed":
            # Indexed once, then removed (DELETE) before this upload reached it: these bytes are new again.
            outcome = await self._document_run(doc, step, WorkflowIDReusePolicy.ALLOW_DUPLICATE)
            if outcome.status == "removed":
                kind = "Removed" if workflow.patched(REMOVED_AGAIN_PATCH) else None
                outcome = DocumentOutcome.failed_from(child_id, "removed again while this upload ran", doc.filename,
                                                      kind)
        if outcome.status == "indexed":
            self.steps.complete(step, detail=f"{_count(outcome.chunks, 'chunk')} from {_count(outcome.pages, 'page')}")
        elif outcome.error in _CANCELLED:
            self.steps.cancel(step)
        else:
            self.steps.fail(step, outcome.error or "failed")
        return outcome

    async def _document_run(self, doc: DocumentInput, step: str, reuse: WorkflowIDReusePolicy, *,
                            again: bool = True) -> DocumentOutcome:
        """The document's outcome: its own job, started here, or the one another upload started (when that one
        failed or was cancelled, and `again`: a run started here after all)."""
        child_id = document_workflow_id(doc.tenant, doc.document_id)
        try:
            async with self.waits.child(child_id, step):  # parked for an operator, it lends this job's slot
                return await (await started_child(workflow.start_child_workflow(
                    IngestDocumentWorkflow.run, doc, id=child_id, id_reuse_policy=reuse,
                    parent_close_policy=workflow.ParentClosePolicy.ABANDON,
                    search_attributes=TypedSearchAttributes([
                        SearchAttributePair(sa.JOB_KIND, "ingest_document"),
                        SearchAttributePair(sa.JOB_STATUS, "queued"),
                        SearchAttributePair(sa.COLLECTION, doc.collection),
                        SearchAttributePair(sa.FILENAME, doc.filename[:256]),
                        SearchAttributePair(sa.DOCUMENT_ID, doc.document_id),
                        SearchAttributePair(sa.TENANT, doc.tenant),
                    ])), CANCEL_AFTER_START_PATCH))
        except WorkflowAlreadyStartedError:
            # Same bytes in the same collection: indexed already, or being indexed by another job.
            self.steps.start(step, detail=f"{child_id}, started by another upload")
            removal = removal_workflow_id(doc.tenant, doc.document_id) if workflow.patched(REMOVED_PATCH) else None
            outcome = await self.call(JobActivities.await_document,
                                      AwaitDocumentInput(workflow_id=child_id, removal_id=removal), step=step)
            outcome.filename = outcome.filename or doc.filename
            if outcome.error == CANCELLED_WITH_ITS_UPLOAD and again and workflow.patched(OWN_RUN_PATCH):
                # That upload's cancel is not this one's. (A person who cancelled the document's own job, or an
                # operator who discarded it, meant the document: that outcome stands.)
                return await self._document_run(doc, step, WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY,
                                                again=False)
            if again and doc.password and _refused_a_password(outcome.error) and workflow.patched(OWN_PASSWORD_PATCH):
                # That run had its upload's password (or none); this upload brings its own.
                return await self._document_run(doc, step, WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY,
                                                again=False)
            return outcome
        except ChildWorkflowError as exc:
            if is_cancelled_exception(exc):
                return DocumentOutcome.failed_from(child_id, CANCELLED, doc.filename, "Cancelled")
            return DocumentOutcome.failed_from(child_id, failure_reason(exc), doc.filename, failure_type(exc))


_CANCELLED = (CANCELLED, CANCELLED_WITH_ITS_UPLOAD)



def _published(undone: PruneOutput | None, chunks: int) -> bool:
    """After a cancel during the publish: nothing was pending any more, and the document's chunks found are
    this run's chunking's (an older one's left over would be more, or fewer): it landed, or it did not
    matter (the same chunks were found before)."""
    return undone is not None and undone.removed == 0 and undone.points == chunks > 0


def _refused_a_password(error: str | None) -> bool:
    return any(refusal in (error or "") for refusal in (WRONG_PASSWORD, PASSWORD_REQUIRED))


def _step_names(documents: list[DocumentInput]) -> list[str]:
    """A step per document, `document:<file>`; files of one name (two folders' report.pdf, files sent without
    a name) are told apart in the upload's order: `document:report.pdf (2)`. One step for both showed
    whichever ended last."""
    names: list[str] = []
    for doc in documents:
        name, n = f"document:{doc.filename}", 1
        while name in names:  # a file may be named like the one told apart before it: `report.pdf (2)`
            n += 1
            name = f"document:{doc.filename} ({n})"
        names.append(name)
    return names


def _count(n: int | None, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
