"""POST /v1/evaluations (golden questions -> an evaluation job), GET /v1/evaluations (reports per collection)."""

from __future__ import annotations

import uuid

import structlog
from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from temporalio.client import WorkflowExecution
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.service import RPCError, RPCStatusCode

from api import job_views, observability
from api.auth import CallerDep
from api.deps import BlobsDep, ClientDep, CursorsDep, RpcTimeoutDep, SettingsDep
from api.errors import ApiError
from api.idempotency import IdempotencyKeyDep, key_digest, request_digest, start_once
from api.schemas import (
    ACCEPTED, INVALID_REQUEST, TEMPORAL_DOWN, EvaluationAccepted, EvaluationList, EvaluationView, error_responses,
    starting,
)
from api.validators import JOB_ID, CursorDep, validate_collection
from models.evaluation import EvaluationInput, EvaluationOutput
from models.jobs import COLLECTION_PATTERN
from models.tenancy import scoped, workflow_id
from ragline import evaluation
from ragline.evaluation import EvaluationReport
from temporal import search_attributes as sa
from workflows.evaluation import EvaluationWorkflow

router = APIRouter(prefix="/v1/evaluations", tags=["evaluations"])

MAX_BODY_BYTES = 5 * 1024 * 1024


@router.post("", status_code=202, summary="Evaluate a collection against golden questions (JSONL body)",
             response_description=ACCEPTED, responses=error_responses({413: "body_too_large",
                                        422: f"{INVALID_REQUEST}, invalid_golden_set, invalid_collection, "
                                             "idempotency_key_reused",
                                        503: TEMPORAL_DOWN}),
             openapi_extra={"requestBody": {"required": True, "content": {"text/plain": {"schema": {
                 "type": "string", "minLength": 1,
                 "description": 'JSONL: one {"question", "expected_document", "expected_answer"?} per line'}}}}})
async def create_evaluation(request: Request, client: ClientDep, caller: CallerDep, blobs: BlobsDep,
                            settings: SettingsDep, timeout: RpcTimeoutDep,
                            collection: str = Query("default", pattern=COLLECTION_PATTERN),
                            k: int = Query(5, ge=1, le=20), answers: bool = Query(False),
                            idempotency_key: IdempotencyKeyDep = None) -> EvaluationAccepted:
    """The body is JSONL, one `{"question", "expected_document", "expected_answer"?}` per line
    (`expected_document` null for a question the documents do not answer)."""
    collection = validate_collection(collection)
    body = await request.body()  # at most MAX_BODY_BYTES: api/limits.py refused anything longer
    try:
        questions = evaluation.parse_jsonl(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ApiError(422, "invalid_golden_set", f"golden questions: {exc}") from None
    ref = await run_in_threadpool(blobs.put, body)  # by content: a resend writes nothing new
    # A keyed job is named by its key alone: the key sent again for another collection is another request.
    name = f"k{key_digest(idempotency_key)}" if idempotency_key is not None else f"{collection}-{uuid.uuid4().hex[:12]}"
    job_id = workflow_id(caller.tenant, f"evaluation-{name}")
    starting(request, job_id)
    duplicate = await start_once(
        client, EvaluationWorkflow.run, EvaluationInput(tenant=caller.tenant, collection=collection, questions_ref=ref,
                                                        questions=len(questions), k=k, answers=answers),
        id=job_id, key=idempotency_key, digest=request_digest("evaluation", collection, k, answers, ref),
        rpc_timeout=timeout, task_queue=settings.task_queue, priority=caller.priority,
        search_attributes=TypedSearchAttributes([SearchAttributePair(sa.JOB_KIND, "evaluation"),
                                                 SearchAttributePair(sa.JOB_STATUS, "queued"),
                                                 SearchAttributePair(sa.COLLECTION, collection),
                                                 SearchAttributePair(sa.TENANT, caller.tenant)]))
    if not duplicate:
        observability.job_accepted("evaluation")
    base = str(request.base_url).rstrip("/")
    structlog.contextvars.bind_contextvars(job_id=job_id)  # the request's access line names its job
    return EvaluationAccepted(job_id=job_id, collection=collection, questions=len(questions), duplicate=duplicate,
                              status_url=f"{base}/v1/jobs/{job_id}", events_url=f"{base}/v1/jobs/{job_id}/events")


@router.get("", summary="Evaluation reports, newest first (from Temporal visibility)",
            responses=error_responses({422: f"{INVALID_REQUEST}, invalid_collection, invalid_cursor",
                                       503: TEMPORAL_DOWN}))
async def list_evaluations(client: ClientDep, cursors: CursorsDep, caller: CallerDep, timeout: RpcTimeoutDep,
                           collection: str | None = Query(None, pattern=COLLECTION_PATTERN),
                           limit: int = Query(20, ge=1, le=200), cursor: CursorDep = None) -> EvaluationList:
    extra = {sa.COLLECTION.name: validate_collection(collection)} if collection else None
    query = job_views.list_query(caller.tenant, kind="evaluation", extra=extra)
    executions, next_cursor = await job_views.list_page(client, cursors, query, limit, cursor, timeout)

    async def view(execution: WorkflowExecution) -> EvaluationView:
        job = job_views.summary(execution)
        report = None
        if job.status == "completed":
            handle = client.get_workflow_handle_for(EvaluationWorkflow.run, execution.id, run_id=execution.run_id)
            out: EvaluationOutput = await handle.result(rpc_timeout=timeout)
            report = out.report
        return EvaluationView(job_id=job.job_id, collection=job.collection, status=job.status,
                              created_at=job.created_at, updated_at=job.updated_at, report=report)
    views = await job_views.gather_reads(view(e) for e in executions)
    return EvaluationList(evaluations=views, next_cursor=next_cursor, query=query)


@router.get("/{job_id}", summary="One evaluation, with every golden question's outcome once it completed",
            responses=error_responses({404: "job_not_found", 422: INVALID_REQUEST, 503: TEMPORAL_DOWN}))
async def get_evaluation(job_id: JOB_ID, client: ClientDep, caller: CallerDep, blobs: BlobsDep,
                         settings: SettingsDep, timeout: RpcTimeoutDep) -> EvaluationView:
    """The report as listed, and per question: the expected document's rank, whether the relevance gate
    let it through, the top hits, and with `answers=true` the answer and whether it (and its citation)
    was right: what to look at when a number is lower than it should be."""
    handle = client.get_workflow_handle_for(EvaluationWorkflow.run, scoped(caller.tenant, job_id))
    try:
        desc = await handle.describe(rpc_timeout=timeout)
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            raise job_views.not_found(job_id) from None
        raise
    if not job_views.owned(desc, caller.tenant) or desc.typed_search_attributes.get(sa.JOB_KIND) != "evaluation":
        raise job_views.not_found(job_id)
    job = job_views.summary(desc)
    report = None
    if job.status == "completed":
        out: EvaluationOutput = await handle.result(rpc_timeout=timeout)
        # The full report (outcomes too) was claim-checked into the blob store: history keeps it small.
        report = EvaluationReport.model_validate_json(await run_in_threadpool(blobs.get, out.report_ref))
    withheld = []
    if report is not None and settings.review_unsupported_answers and not caller.is_reviewer \
            and any(o.answer is not None for o in report.outcomes):
        # The model's answers were reviewed by nobody: where answers wait for a reviewer, only reviewers read
        # them (a member learns from `answer_correct` whether each was right).
        report = report.model_copy(update={"outcomes": [o.model_copy(update={"answer": None})
                                                        for o in report.outcomes]})
        withheld = ["answer"]
    return EvaluationView(job_id=job.job_id, collection=job.collection, status=job.status,
                          created_at=job.created_at, updated_at=job.updated_at, report=report, withheld=withheld)
