"""Removing a document (DELETE /v1/documents/{document_id}).

RemoveDocumentWorkflow (one job per removal; kind `remove_document`)
  remove_document_chunks  nobody finds the document any more (the collection's cached answers go too)
  -> forget_document      its ingestion job leaves Temporal: it is no longer listed, and the same bytes
                          uploaded again are ingested anew

The chunks go first: a removal that fails between the two steps leaves a document listed that nobody
finds, never one found that is not listed.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.ingest import IngestActivities
    from activities.jobs import JobActivities
    from models.ingest import (
        ForgetDocumentInput, RemovalResult, RemoveDocumentInput, RemoveInput, document_workflow_id,
    )
    from workflows.job import JobWorkflow


@workflow.defn
class RemoveDocumentWorkflow(JobWorkflow):
    PLANNED = (IngestActivities.remove_document_chunks, JobActivities.forget_document)

    @workflow.run
    async def run(self, doc: RemoveDocumentInput) -> RemovalResult:
        return await self.run_job(lambda: self._remove(doc), accepted={
            "document_id": doc.document_id, "filename": doc.filename, "collection": doc.collection})

    async def _remove(self, doc: RemoveDocumentInput) -> RemovalResult:
        removed = await self.step(IngestActivities.remove_document_chunks, RemoveInput(
            tenant=doc.tenant, document_id=doc.document_id, collection=doc.collection))
        forgotten = await self.step(JobActivities.forget_document, ForgetDocumentInput(
            workflow_id=document_workflow_id(doc.tenant, doc.document_id)))
        return RemovalResult(document_id=doc.document_id, filename=doc.filename, collection=doc.collection,
                             chunks_removed=removed.removed, ingestion_runs_forgotten=forgotten.runs)
