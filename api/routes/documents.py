"""POST /v1/documents (upload -> ingestion job), GET /v1/documents."""

from __future__ import annotations

import hashlib
import re
import unicodedata
from typing import Annotated

from fastapi import APIRouter, Depends, File, Form, Query, Request, UploadFile
from fastapi.responses import JSONResponse
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import (
    SearchAttributePair, TypedSearchAttributes, WorkflowIDConflictPolicy, WorkflowIDReusePolicy,
)
from temporalio.service import RPCError, RPCStatusCode

from api import jobs
from api.deps import get_blobs, get_client, get_settings, rpc_timeout
from api.errors import ApiError
from ragline.blobstore import BlobStore
from ragline.settings import Settings
from ragline.text import sniff_kind
from temporal import search_attributes as sa
from workflows.ingest import IngestWorkflow
from workflows.models import DocumentInput, IngestInput, IngestResult

router = APIRouter(prefix="/v1/documents", tags=["documents"])

COLLECTION_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_FILES_PER_REQUEST = 50
SNIFF_BYTES = 4096


def validate_collection(collection: str) -> str:
    if not COLLECTION_RE.match(collection):
        raise ApiError(422, "invalid_collection",
                       "collection must be 1-64 characters of letters, digits, '_' or '-'", collection=collection)
    return collection


def display_name(filename: str | None) -> str:
    """A filename for display only; it is never used as a path."""
    name = (filename or "").replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(ch for ch in name if unicodedata.category(ch)[0] != "C").strip()
    return name[:255] or "unnamed"


def document_id(collection: str, sha256: str) -> str:
    return hashlib.sha256(f"{collection}\n{sha256}".encode()).hexdigest()[:32]


def ingest_job_id(collection: str, document_ids: list[str]) -> str:
    key = collection + "\n" + "\n".join(sorted(document_ids))
    return "ingest-" + hashlib.sha256(key.encode()).hexdigest()[:24]


async def _store_upload(upload: UploadFile, blobs: BlobStore, settings: Settings) -> dict:
    name = display_name(upload.filename)
    head = await upload.read(SNIFF_BYTES)
    if not head:
        raise ApiError(400, "empty_file", f"{name}: the file is empty", file=name)
    kind = sniff_kind(head)
    if kind is None:
        raise ApiError(415, "unsupported_file_type",
                       f"{name}: not a PDF or UTF-8 text file (judged by its content, not its name)", file=name)
    await upload.seek(0)
    try:
        ref, size = blobs.put_stream(upload.file, limit=settings.max_upload_bytes)
    except OverflowError:
        raise ApiError(413, "file_too_large",
                       f"{name}: larger than the upload limit of {settings.max_upload_mb:g} MB "
                       "(RAGLINE_MAX_UPLOAD_MB)", file=name) from None
    sha = ref.removeprefix("sha256:")
    return {"filename": name, "ref": ref, "sha256": sha, "size": size, "kind": kind}


@router.post("", status_code=202, summary="Upload documents; answers at once with an ingestion job")
async def upload_documents(
    request: Request,
    files: Annotated[list[UploadFile], File(description="One or more PDF, .txt or .md files")],
    collection: Annotated[str, Form()] = "default",
    password: Annotated[str | None, Form(description="Password of encrypted PDFs")] = None,
    client: Client = Depends(get_client), blobs: BlobStore = Depends(get_blobs),
    settings: Settings = Depends(get_settings),
) -> JSONResponse:
    validate_collection(collection)
    if len(files) > MAX_FILES_PER_REQUEST:
        raise ApiError(413, "too_many_files", f"at most {MAX_FILES_PER_REQUEST} files per request")
    stored = [await _store_upload(f, blobs, settings) for f in files]

    documents: dict[str, DocumentInput] = {}
    for item in stored:
        doc_id = document_id(collection, item["sha256"])
        documents.setdefault(doc_id, DocumentInput(
            document_id=doc_id, collection=collection, filename=item["filename"], blob_ref=item["ref"],
            sha256=item["sha256"], size=item["size"], kind=item["kind"], password=password or None))
    job_id = ingest_job_id(collection, list(documents))
    duplicate = await _already_done_or_running(client, job_id, settings)
    if not duplicate:
        await client.start_workflow(
            IngestWorkflow.run, IngestInput(collection=collection, documents=list(documents.values())),
            id=job_id, task_queue=settings.task_queue,
            # Same files again: a running job is reused; a finished one that failed may run again.
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            search_attributes=TypedSearchAttributes([
                SearchAttributePair(sa.JOB_KIND, "ingest"),
                SearchAttributePair(sa.JOB_STATUS, "queued"),
                SearchAttributePair(sa.COLLECTION, collection),
            ]),
            rpc_timeout=rpc_timeout(settings))
    body = {
        "job_id": job_id,
        "status_url": str(request.url_for("get_job", job_id=job_id)),
        "events_url": str(request.url_for("job_events", job_id=job_id)),
        "duplicate": duplicate,
        "documents": [{"document_id": d.document_id, "filename": d.filename, "sha256": d.sha256}
                      for d in documents.values()],
    }
    return JSONResponse(body, status_code=202)


async def _already_done_or_running(client: Client, job_id: str, settings: Settings) -> bool:
    """True when the same upload is running or has already indexed every document."""
    handle = client.get_workflow_handle(job_id, result_type=IngestResult)
    try:
        desc = await handle.describe(rpc_timeout=rpc_timeout(settings))
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return False
        raise
    if desc.status == WorkflowExecutionStatus.RUNNING:
        return True
    if desc.status == WorkflowExecutionStatus.COMPLETED:
        result = await handle.result(rpc_timeout=rpc_timeout(settings))
        return result.failed == 0
    return False


@router.get("", summary="Documents of a collection with their status and chunk counts")
async def list_documents(collection: str | None = Query(None), limit: int = Query(200, ge=1, le=1000),
                         client: Client = Depends(get_client), settings: Settings = Depends(get_settings)) -> dict:
    extra = {sa.COLLECTION.name: validate_collection(collection)} if collection else None
    query = jobs.list_query(kind="ingest_document", extra=extra)
    executions = await jobs.list_jobs(client, query, limit, rpc_timeout(settings))
    documents = []
    for e in executions:
        attrs = e.typed_search_attributes
        documents.append({
            "document_id": attrs.get(sa.DOCUMENT_ID), "filename": attrs.get(sa.FILENAME),
            "collection": attrs.get(sa.COLLECTION), "status": _document_status(jobs.job_status(e)),
            "chunks": attrs.get(sa.CHUNKS), "pages": attrs.get(sa.PAGES), "job_id": e.id,
            "created_at": e.start_time, "updated_at": e.close_time or e.start_time,
        })
    return {"documents": documents}


def _document_status(job_status: str) -> str:
    return {"completed": "indexed"}.get(job_status, job_status)
