"""POST /v1/documents (upload -> ingestion job), GET /v1/documents, DELETE /v1/documents/{document_id}."""

from __future__ import annotations

import asyncio
import hashlib
from datetime import datetime, timedelta
from typing import Annotated, NamedTuple

from fastapi import APIRouter, Depends, File, Form, Path, Query, Request, UploadFile
from fastapi.concurrency import run_in_threadpool
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import (
    SearchAttributePair, TypedSearchAttributes, WorkflowIDConflictPolicy, WorkflowIDReusePolicy,
)
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from api import job_views, observability
from api.auth import Caller, CallerDep, GuardDep
from api.deps import BlobsDep, ClientDep, CursorsDep, RpcTimeoutDep, SettingsDep
from api.errors import MAX_FILES_PER_REQUEST, ApiError, audited
from api.limits import SMALL_BODY_BYTES, Cap
from api.schemas import (
    ACCEPTED, INVALID_REQUEST, TEMPORAL_DOWN, AcceptedDocument, DocumentList, DocumentRemovalAccepted,
    DocumentsAccepted, DocumentStatus, DocumentView, JobError, error_responses, starting,
)
from api.validators import COLLECTION_PATTERN, CursorDep, display_name, validate_collection
from models.ingest import (
    DocumentInput, IngestInput, IngestResult, RemoveDocumentInput, document_workflow_id, removal_workflow_id,
)
from models.jobs import JobStatus
from models.tenancy import workflow_id
from ragline import audit
from ragline.blobstore import BlobStore
from ragline.keys import TenantLimits
from ragline.settings import Settings
from ragline.text import sniff_kind
from temporal import search_attributes as sa
from workflows.ingest import IngestWorkflow
from workflows.remove import RemoveDocumentWorkflow

router = APIRouter(prefix="/v1/documents", tags=["documents"])

DOCUMENT_ID_PATTERN = r"^[0-9a-f]{32}$"
SNIFF_BYTES = 4096
UPLOAD_FIELDS = {"files", "collection", "password"}


def document_id(tenant: str, collection: str, sha256: str) -> str:
    """Per tenant: two tenants uploading the same bytes get two documents."""
    return hashlib.sha256(f"{tenant}\n{collection}\n{sha256}".encode()).hexdigest()[:32]


def ingest_job_id(tenant: str, collection: str, document_ids: list[str], password_tag: str = "") -> str:
    key = collection + "\n" + "\n".join(sorted(document_ids)) + (f"\npassword {password_tag}" if password_tag else "")
    return workflow_id(tenant, "ingest-" + hashlib.sha256(key.encode()).hexdigest()[:24])


class UploadLimit(NamedTuple):
    """The largest file a tenant may upload, and what sets it (a 413 says so)."""
    mb: float
    source: str

    @property
    def bytes(self) -> int:
        return int(self.mb * 1024 * 1024)


def upload_limit(settings: Settings, limits: TenantLimits) -> UploadLimit:
    """The tenant's max_upload_mb where it is below the deployment's, else the deployment's."""
    if limits.max_upload_mb is not None and limits.max_upload_mb < settings.max_upload_mb:
        return UploadLimit(limits.max_upload_mb, "the tenant's max_upload_mb")
    return UploadLimit(settings.max_upload_mb, "RAGLINE_MAX_UPLOAD_MB")


def body_cap(settings: Settings, limits: TenantLimits) -> Cap:
    """The largest upload body of a tenant, refused from its Content-Length (api/limits.py): the most
    files a request may carry, each at the tenant's limit, and room for the form around them. Without
    it, a tenant limited to 1 MB could still have the API read and spool every file up to the
    deployment's limit before the route refuses them."""
    per_file = upload_limit(settings, limits)
    return Cap(MAX_FILES_PER_REQUEST * per_file.bytes + SMALL_BODY_BYTES, f"{MAX_FILES_PER_REQUEST} files of at "
               f"most {per_file.mb:g} MB each, {per_file.source}, and the form around them")


def _too_large(name: str, limit: UploadLimit) -> ApiError:
    return ApiError(413, "file_too_large", f"{name}: larger than the upload limit of {limit.mb:g} MB ({limit.source})",
                    file=name)


async def _check_upload(upload: UploadFile, limit: UploadLimit) -> tuple[str, str]:
    """The file's display name and kind, or the reason it is refused: every file of a request is
    checked before any is stored, so a refused request leaves nothing in the blob store."""
    name = display_name(upload.filename)
    head = await upload.read(SNIFF_BYTES)
    if not head:
        raise ApiError(400, "empty_file", f"{name}: the file is empty", file=name)
    kind = sniff_kind(head)
    if kind is None:
        raise ApiError(415, "unsupported_file_type",
                       f"{name}: not a PDF or UTF-8 text file (judged by its content, not its name)", file=name)
    if kind != "pdf" and name.lower().endswith(".pdf"):
        # Indexed as text it would not be what its sender meant (a PDF saved badly, or another file renamed):
        # the sender is told at once rather than find a document of a page of plain text.
        raise ApiError(415, "unsupported_file_type", f"{name}: named .pdf, but its content is not a PDF (it is "
                       "plain text): send a PDF, or give a text file a .txt or .md name", file=name)
    if upload.size is not None and upload.size > limit.bytes:
        raise _too_large(name, limit)
    await upload.seek(0)
    return name, kind


async def _store_upload(upload: UploadFile, name: str, kind: str, blobs: BlobStore, limit: UploadLimit) -> dict:
    try:
        # Copying (and fsyncing) up to the limit: in a thread, not on the loop every other request shares.
        ref, size = await run_in_threadpool(blobs.put_stream, upload.file, limit=limit.bytes)
    except OverflowError:  # a size the form did not tell
        raise _too_large(name, limit) from None
    sha = ref.removeprefix("sha256:")
    return {"filename": name, "ref": ref, "sha256": sha, "size": size, "kind": kind}


async def strict_upload_form(request: Request) -> None:
    """Strict, as JSON bodies are: a misspelt `colection`, or `collection` sent twice, put the files in
    `default` (or in the last one named) without a word. A dependency, so that it is told before the
    field checks: a file sent as `file` is named as such, not only as "files: Field required"."""
    form = await request.form()  # read (and kept) by FastAPI already
    if unknown := sorted(set(form.keys()) - UPLOAD_FIELDS):
        raise ApiError(422, "invalid_request", f"unknown form field(s): {', '.join(unknown)}; an upload takes "
                       f"{', '.join(sorted(UPLOAD_FIELDS))}", fields=unknown)
    if repeated := [name for name in ("collection", "password") if len(form.getlist(name)) > 1]:
        raise ApiError(422, "invalid_request", f"{' and '.join(repeated)} given more than once: give each once",
                       fields=repeated)


@router.post("", status_code=202, summary="Upload documents; answers at once with an ingestion job",
             response_description=ACCEPTED, dependencies=[Depends(strict_upload_form)],
             responses=error_responses({400: "empty_file", 409: "document_being_removed, upload_still_running",
                                        413: "too_many_files, file_too_large",
                                        415: "unsupported_file_type", 422: f"{INVALID_REQUEST}, invalid_collection",
                                        503: TEMPORAL_DOWN}))
async def upload_documents(
    request: Request,
    files: Annotated[list[UploadFile], File(description="One or more PDF, .txt or .md files", min_length=1)],
    client: ClientDep, caller: CallerDep, guard: GuardDep, blobs: BlobsDep, settings: SettingsDep,
    timeout: RpcTimeoutDep,
    collection: Annotated[str, Form(pattern=COLLECTION_PATTERN)] = "default",
    password: Annotated[str | None, Form(description="Password of encrypted PDFs")] = None,
) -> DocumentsAccepted:
    form = await request.form()
    # An empty form field reads as "not sent" (the default) to FastAPI: it is a bad name, not the default.
    if form.get("collection") == "":
        validate_collection("")
    validate_collection(collection)
    if len(files) > MAX_FILES_PER_REQUEST:
        raise ApiError(413, "too_many_files", f"at most {MAX_FILES_PER_REQUEST} files per request")
    limits = guard.limits(caller.tenant)
    per_file = upload_limit(settings, limits)
    checked = [await _check_upload(f, per_file) for f in files]
    stored = [await _store_upload(f, name, kind, blobs, per_file) for f, (name, kind) in zip(files, checked)]

    documents: dict[str, DocumentInput] = {}
    same_content: dict[str, list[str]] = {}  # a document's other file names in this request
    for item in stored:
        doc_id = document_id(caller.tenant, collection, item["sha256"])
        if doc_id in documents:
            same_content.setdefault(doc_id, []).append(item["filename"])
        documents.setdefault(doc_id, DocumentInput(
            tenant=caller.tenant, document_id=doc_id, collection=collection, filename=item["filename"],
            blob_ref=item["ref"], sha256=item["sha256"], size=item["size"], kind=item["kind"],
            password=password or None, max_pages=limits.max_pages,
            max_documents=limits.max_documents or settings.tenant_max_documents,
            metrics_collection_label=settings.metrics_collection_label))
    await _refuse_documents_being_removed(client, caller.tenant, documents, timeout)
    job_id = ingest_job_id(caller.tenant, collection, list(documents),
                           request.app.state.password_tags.tag(password or None))
    duplicate = await _already_done_or_running(client, job_id, caller.tenant, list(documents), timeout)
    indexed_as = await _indexed_names(client, caller.tenant, documents, timeout) if duplicate else {}
    if not duplicate:
        starting(request, job_id)
        await client.start_workflow(
            IngestWorkflow.run, IngestInput(tenant=caller.tenant, collection=collection,
                                            documents=list(documents.values())),
            id=job_id, task_queue=settings.task_queue, priority=caller.priority,
            # Same files again: a running job is reused; a finished one that failed may run again.
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            search_attributes=TypedSearchAttributes([
                SearchAttributePair(sa.JOB_KIND, "ingest"),
                SearchAttributePair(sa.JOB_STATUS, "queued"),
                SearchAttributePair(sa.COLLECTION, collection),
                SearchAttributePair(sa.TENANT, caller.tenant),
            ]),
            rpc_timeout=timeout)
        observability.job_accepted("ingest")
    return DocumentsAccepted.for_job(request, job_id, duplicate=duplicate, documents=[
        AcceptedDocument(document_id=d.document_id, filename=d.filename, sha256=d.sha256,
                         same_content=same_content.get(d.document_id, []), indexed_as=indexed_as.get(d.document_id))
        for d in documents.values()])


async def _refuse_documents_being_removed(client: Client, tenant: str, documents: dict[str, DocumentInput],
                                          timeout: timedelta) -> None:
    """409 for a file whose document is being removed: until its removal ends, the document's old job is
    still there, and the upload would be taken for one already indexed."""
    async def removing(document_id: str) -> str | None:
        removal = removal_workflow_id(tenant, document_id)
        desc = await job_views.describe_or_none(client, removal, timeout)
        return removal if desc is not None and desc.status == WorkflowExecutionStatus.RUNNING else None

    removals = await asyncio.gather(*(removing(d) for d in documents))
    for doc, removal in zip(documents.values(), removals):
        if removal:
            raise ApiError(409, "document_being_removed", f"{doc.filename}: the same document is being removed by "
                           f"job {removal}; upload it again once that job has ended", file=doc.filename,
                           job_id=removal)


async def _indexed_names(client: Client, tenant: str, documents: dict[str, DocumentInput],
                         timeout: timedelta) -> dict[str, str]:
    """Of a duplicate upload's documents, those indexed (or being indexed) under another file name: that one
    is what citations, search hits and listings show."""
    descs = await asyncio.gather(*(job_views.describe_or_none(client, document_workflow_id(tenant, d), timeout)
                                   for d in documents))
    names = {d: desc.typed_search_attributes.get(sa.FILENAME) for d, desc in zip(documents, descs) if desc}
    return {d: name for d, name in names.items() if name and name != documents[d].filename}


async def _ingestion_of(client: Client, ingestion: str, tenant: str, timeout: timedelta):  # noqa: ANN202
    """The document's ingestion job (its latest run), or None when there is none of this tenant."""
    desc = await job_views.describe_or_none(client, ingestion, timeout)
    return desc if desc is not None and job_views.owned(desc, tenant) else None


async def _removed_after(client: Client, tenant: str, document_id: str, since: datetime, timeout: timedelta) -> bool:
    removal = await job_views.describe_or_none(client, removal_workflow_id(tenant, document_id), timeout)
    return removal is not None and removal.start_time >= since and removal.status in (
        WorkflowExecutionStatus.RUNNING, WorkflowExecutionStatus.COMPLETED)


async def _indexed(client: Client, workflow_id: str, timeout: timedelta) -> bool:
    desc = await job_views.describe_or_none(client, workflow_id, timeout)
    return desc is not None and desc.status == WorkflowExecutionStatus.COMPLETED


async def _already_done_or_running(client: Client, job_id: str, tenant: str, document_ids: list[str],
                                   timeout: timedelta) -> bool:
    """True when the same upload is running or has already indexed every document, none of them removed since."""
    handle = client.get_workflow_handle(job_id, result_type=IngestResult)
    try:
        desc = await handle.describe(rpc_timeout=timeout)
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return False
        raise
    if desc.status == WorkflowExecutionStatus.RUNNING:
        removed = [d for d, gone in zip(document_ids, await asyncio.gather(*(
            _removed_after(client, tenant, d, desc.start_time, timeout) for d in document_ids))) if gone]
        if removed:
            raise ApiError(409, "upload_still_running", f"the same upload (job {job_id}) is still running, and "
                           f"{len(removed)} of its documents were removed since it began: send it again once that "
                           "job has ended, or upload those files on their own", job_id=job_id)
        return True
    if desc.status == WorkflowExecutionStatus.COMPLETED:
        result = await handle.result(rpc_timeout=timeout)
        if result.failed:
            return False
        # A removed document's job is gone from Temporal: the same upload indexes it again. So does one
        # whose latest run is another upload's that failed or was cancelled since the removal.
        return all(await asyncio.gather(*(_indexed(client, document_workflow_id(tenant, d), timeout)
                                          for d in document_ids)))
    return False


@router.delete("/{document_id}", status_code=202, summary="Remove a document; answers at once with a job",
               response_description=ACCEPTED,
               responses=error_responses({404: "document_not_found", 409: "document_busy",
                                          422: INVALID_REQUEST, 503: TEMPORAL_DOWN}))
@audited("remove_document")
async def remove_document(
    request: Request, client: ClientDep, caller: CallerDep, settings: SettingsDep, timeout: RpcTimeoutDep,
    document_id: Annotated[str, Path(pattern=DOCUMENT_ID_PATTERN, description=(
        "As `POST /v1/documents`, `GET /v1/documents` and search hits give it"))],
    collection: Annotated[str | None, Query(pattern=COLLECTION_PATTERN, description=(
        "Needed only for a document indexed longer ago than the retention (its ingestion job is gone): "
        "the collection its chunks are in"))] = None,
) -> DocumentRemovalAccepted:
    """The removal job takes the document's chunks out of the index (no search or answer finds it, and the
    collection's cached answers go), then its ingestion job out of Temporal: it is no longer listed, and the
    same bytes uploaded again are ingested anew. A document still being ingested (or waiting for an operator)
    is refused with 409: cancel or discard its job first."""
    with audit.recorded(settings, action="remove_document", document_id=document_id,
                        job_id=document_workflow_id(caller.tenant, document_id), **caller.on_record) as details:
        accepted = await _start_removal(request, client, caller, settings, timeout, document_id,
                                        validate_collection(collection) if collection is not None else None)
        details.update(removal_job=accepted.job_id, duplicate=accepted.duplicate)
    return accepted


async def _start_removal(request: Request, client: Client, caller: Caller, settings: Settings, timeout: timedelta,
                         document_id: str, named: str | None) -> DocumentRemovalAccepted:
    ingestion = document_workflow_id(caller.tenant, document_id)
    desc = await _ingestion_of(client, ingestion, caller.tenant, timeout)
    if desc is None and named is None:
        raise ApiError(404, "document_not_found", f"no ingestion job of document {document_id}: removed, never "
                       "uploaded with this tenant's keys, or indexed longer ago than the retention (the namespace's, "
                       "RAGLINE_TEMPORAL_RETENTION); for the last, name its collection (?collection=) and its chunks "
                       "are removed")
    attrs = desc.typed_search_attributes if desc is not None else None
    collection = (attrs.get(sa.COLLECTION) if attrs else None) or named or "default"
    filename = (attrs.get(sa.FILENAME) if attrs else None) or ""
    if named is not None and named != collection:
        raise ApiError(404, "document_not_found", f"document {document_id} is not in collection {named}")
    if desc is not None and desc.status == WorkflowExecutionStatus.RUNNING:
        raise ApiError(409, "document_busy", f"document {document_id} is still being ingested by job {ingestion} "
                       f"({job_views.job_status(desc)}): cancel it (POST /v1/jobs/{ingestion}/cancel), discard it "
                       "if it waits for an operator, or wait for it to end", job_id=ingestion)
    job_id = removal_workflow_id(caller.tenant, document_id)
    starting(request, job_id)
    try:
        await client.start_workflow(
            RemoveDocumentWorkflow.run, RemoveDocumentInput(tenant=caller.tenant, document_id=document_id,
                                                            collection=collection, filename=filename,
                                                            run_id=desc.run_id if desc else None,
                                                            run_started_at=desc.start_time if desc else None),
            id=job_id, task_queue=settings.task_queue, priority=caller.priority,
            # The same document uploaded again after a removal may be removed again.
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
            search_attributes=TypedSearchAttributes([
                SearchAttributePair(sa.JOB_KIND, "remove_document"),
                SearchAttributePair(sa.JOB_STATUS, "queued"),
                SearchAttributePair(sa.COLLECTION, collection),
                SearchAttributePair(sa.FILENAME, filename[:256]),
                SearchAttributePair(sa.DOCUMENT_ID, document_id),
                SearchAttributePair(sa.TENANT, caller.tenant),
            ]),
            rpc_timeout=timeout)
        duplicate = False
        observability.job_accepted("remove_document")
    except WorkflowAlreadyStartedError:
        duplicate = True  # a removal of it runs: that job answers, with the collection and name it was given
        running = await job_views.describe_or_none(client, job_id, timeout)
        if running is not None:
            attrs = running.typed_search_attributes
            collection, filename = attrs.get(sa.COLLECTION) or collection, attrs.get(sa.FILENAME) or filename
    return DocumentRemovalAccepted.for_job(request, job_id, duplicate=duplicate, document_id=document_id,
                                           filename=filename, collection=collection)


@router.get("", summary="Documents of a collection with their status and chunk counts",
            responses=error_responses({422: f"{INVALID_REQUEST}, invalid_collection, invalid_cursor",
                                       503: TEMPORAL_DOWN}))
async def list_documents(client: ClientDep, cursors: CursorsDep, caller: CallerDep, timeout: RpcTimeoutDep,
                         collection: Annotated[str | None, Query(pattern=COLLECTION_PATTERN)] = None,
                         limit: Annotated[int, Query(ge=1, le=1000)] = 200, cursor: CursorDep = None) -> DocumentList:
    extra = {sa.COLLECTION.name: validate_collection(collection)} if collection else None
    query = job_views.list_query(caller.tenant, kind="ingest_document", extra=extra)
    executions, next_cursor = await job_views.list_page(client, cursors, query, limit, cursor, timeout)
    views = [_document_view(e) for e in executions]
    if views:
        removals = job_views.list_query(caller.tenant, kind="remove_document", extra=extra) + \
            " AND ExecutionStatus = 'Running'"
        being_removed = {e.typed_search_attributes.get(sa.DOCUMENT_ID)
                         for e in await job_views.list_jobs(client, removals, 1000, timeout)}
        for view in views:
            if view.document_id in being_removed:
                view.status = "removing"  # listed until its removal has deleted its job
    # Why a document failed, or waits for an operator (dead-lettered), without opening its job.
    stuck = [(view, e) for view, e in zip(views, executions) if view.status in ("failed", "dead_lettered")]
    reasons = await job_views.gather_reads(_reason(client, view, e, timeout) for view, e in stuck)
    for (view, _), reason in zip(stuck, reasons):
        view.error = reason.message if reason else None
    return DocumentList(documents=views, next_cursor=next_cursor)


async def _reason(client: Client, view: DocumentView, execution, timeout: timedelta) -> JobError | None:  # noqa: ANN001
    handle = client.get_workflow_handle(execution.id, run_id=execution.run_id)
    if view.status == "failed":
        return await job_views.failure_of(handle, execution, timeout)
    return await job_views.dead_letter_of(handle, timeout)


def _document_view(execution) -> DocumentView:
    attrs = execution.typed_search_attributes
    return DocumentView(
        document_id=attrs.get(sa.DOCUMENT_ID), filename=attrs.get(sa.FILENAME), collection=attrs.get(sa.COLLECTION),
        status=_document_status(job_views.job_status(execution)), chunks=attrs.get(sa.CHUNKS),
        pages=attrs.get(sa.PAGES), job_id=execution.id, created_at=execution.start_time,
        updated_at=execution.close_time or execution.start_time)


def _document_status(job_status: JobStatus) -> DocumentStatus:
    return "indexed" if job_status == "completed" else job_status
