"""Ingestion: documents, the DAG's step inputs and outputs, and search over what was indexed.
Large data (bytes, page texts, chunks, vectors) never travels here: only blob references do."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel

from models.jobs import StepResult
from models.tenancy import DEFAULT_TENANT, workflow_id

DocumentKind = Literal["pdf", "text"]


class DocumentInput(BaseModel):
    tenant: str = DEFAULT_TENANT
    document_id: str
    collection: str
    filename: str
    blob_ref: str
    sha256: str
    size: int
    kind: DocumentKind
    password: str | None = None
    # RAGLINE_METRICS_COLLECTION_LABEL: the ingestion counters may carry the collection.
    metrics_collection_label: bool = False
    # The tenant's page ceiling (RAGLINE_MAX_PAGES unless its keys-file entry says less).
    max_pages: int | None = None
    # The documents the tenant may hold ([tenants.<name>] max_documents, else RAGLINE_TENANT_MAX_DOCUMENTS).
    max_documents: int | None = None


CANCELLED = "cancelled"  # a document outcome's error when its job was cancelled (not its input's fault)
# ... as another upload that waited for it sees it when the upload that started it was cancelled (not the
# document's own job): that upload runs the document itself.
CANCELLED_WITH_ITS_UPLOAD = "cancelled with the upload that started it"


class DocumentOutcome(BaseModel):
    document_id: str
    filename: str = ""
    # "removed": await_document found the document's job removed (DELETE) since: it is ingested anew.
    status: Literal["indexed", "failed", "removed"]
    job_id: str
    pages: int = 0
    chunks: int = 0
    error: str | None = None
    # The failure's type (InputError: the file itself; Discarded, DeadLetterExpired: an operator or the time
    # limit ended a step an outage had parked; Removed: a DELETE took it out again while its upload ran); None
    # where it is not known (earlier outcomes).
    error_type: str | None = None

    @classmethod
    def failed_from(cls, workflow_id: str, error: str, filename: str = "",
                    error_type: str | None = None) -> "DocumentOutcome":
        return cls(document_id=workflow_id.rsplit("doc-", 1)[-1], filename=filename, status="failed",
                   job_id=workflow_id, error=error, error_type=error_type)


class IngestInput(BaseModel):
    tenant: str = DEFAULT_TENANT
    collection: str
    documents: list[DocumentInput]


class IngestResult(BaseModel):
    collection: str
    indexed: int
    failed: int
    documents: list[DocumentOutcome]


def document_workflow_id(tenant: str, document_id: str) -> str:
    return workflow_id(tenant, f"doc-{document_id}")


def removal_workflow_id(tenant: str, document_id: str) -> str:
    """One removal of a document at a time: a DELETE sent again while it runs finds it."""
    return workflow_id(tenant, f"remove-{document_id}")


class RemoveDocumentInput(BaseModel):
    """DELETE /v1/documents/{document_id}: the document as its ingestion job names it, and that job's run
    when the removal was asked for (the latest; it had ended). No run: the job is gone (older than the
    namespace's retention), the chunks are removed from the collection the request named."""
    tenant: str = DEFAULT_TENANT
    document_id: str
    collection: str
    filename: str = ""
    run_id: str | None = None
    run_started_at: datetime | None = None


class RemovalResult(BaseModel):
    document_id: str
    filename: str
    collection: str
    status: Literal["removed", "not_found"] = "removed"  # not_found: nothing of the tenant's had that id
    chunks_removed: int
    ingestion_runs_forgotten: int


# -- the DAG's steps -------------------------------------------------------------------------------

class ExtractInput(BaseModel):
    document_id: str
    blob_ref: str
    filename: str
    kind: DocumentKind
    password: str | None = None
    max_pages: int | None = None


class ExtractOutput(StepResult):
    pages_ref: str
    pages: int
    chars: int


class ChunkInput(BaseModel):
    document_id: str
    pages_ref: str


class ChunkOutput(StepResult):
    chunks_ref: str
    chunks: int
    # Chosen by the activity from settings and recorded in history, so replays plan the same batches.
    batch_size: int
    parallelism: int


class EmbedInput(BaseModel):
    chunks_ref: str
    start: int
    end: int


class EmbedOutput(StepResult):
    vectors_ref: str
    count: int
    model: str


class IndexInput(BaseModel):
    tenant: str = DEFAULT_TENANT
    document_id: str
    collection: str
    filename: str
    chunks_ref: str
    vectors_ref: str
    start: int
    end: int
    max_documents: int | None = None  # DocumentInput's: a new document past it is refused


class IndexOutput(StepResult):
    points: int


class PruneInput(BaseModel):
    tenant: str = DEFAULT_TENANT
    document_id: str
    collection: str
    keep_chunks: int


class RemoveInput(BaseModel):
    tenant: str = DEFAULT_TENANT
    document_id: str
    collection: str
    # Only the chunks no search finds yet: the undo of a failed ingestion, whose document may have been
    # indexed before by a run past the retention (its published chunks stay). A removal takes them all.
    pending_only: bool = False
    # Only the chunks written before this moment (time.time()): the removal's, from confirm_removal.
    written_before: float | None = None


class RemovalConfirmed(StepResult):
    at: float | None = None  # when it was confirmed (time.time()): what was written after it stays


class PruneOutput(StepResult):
    points: int  # the document's chunks left in the index
    removed: int = 0  # chunks this step removed (remove_document_chunks)


class AwaitDocumentInput(BaseModel):
    workflow_id: str
    removal_id: str | None = None  # the document's removal job: an outcome it removed since is "removed"


class ForgetDocumentInput(BaseModel):
    """The document's ingestion job, and its run the removal was asked for: that run and the ones before it
    go; a newer one (the same bytes uploaded again since) stays."""
    workflow_id: str
    run_id: str | None = None
    run_started_at: datetime | None = None


class NewerRun(StepResult):
    """A run of the document's job that started after the removal was confirmed (an upload queued before the
    DELETE), once it has ended."""
    started: bool = False
    indexed: bool = False
    # When it was seen ended (time.time()): what it wrote was written before; a run after it keeps its chunks.
    at: float | None = None


class ForgetDocumentOutput(StepResult):
    runs: int


# -- search ------------------------------------------------------------------------------------------

class SearchInput(BaseModel):
    tenant: str = DEFAULT_TENANT
    query: str
    collection: str
    top_k: int = 5


class SearchHit(BaseModel):
    text: str
    document_id: str
    filename: str
    page: int
    chunk: int
    score: float
    # Calibrated probability (0..1) that the passage answers the query (ragline/relevance.py).
    relevance: float = 0.0


class SearchOutput(BaseModel):
    hits: list[SearchHit]
    # What the caller should know besides the hits: the collection has no documents (a misspelt name?).
    warnings: list[str] = []
