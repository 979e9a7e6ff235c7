"""POST /v1/agents, GET /v1/reviews, POST /v1/jobs/{job_id}/review."""

from __future__ import annotations

import asyncio
import uuid

import structlog
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from temporalio.client import WorkflowQueryFailedError
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.service import RPCError

from api import job_views, observability
from api.auth import CallerDep, reviewer_only
from api.deps import ClientDep, RpcTimeoutDep, SettingsDep
from api.errors import ApiError, audited
from api.idempotency import IdempotencyKeyDep, decision_id, key_digest, request_digest, start_once
from api.schemas import (
    ACCEPTED, INVALID_REQUEST, TEMPORAL_DOWN, AgentAccepted, ReviewItem, ReviewList, ReviewResult, error_responses,
    starting,
)
from api.validators import JOB_ID, review_timeout_seconds, validate_collection
from models.agent import AgentInput, Budget
from models.inputs import NOT_BLANK, STRICT_INPUT, Int
from models.jobs import COLLECTION_PATTERN, REVIEW_PENDING_MEMO
from models.review import ReviewAck, ReviewDecision
from models.tenancy import scoped, workflow_id
from ragline import audit
from ragline.llm import too_long_a_goal
from temporal import search_attributes as sa
from workflows.agent import AgentWorkflow

router = APIRouter(tags=["agents"])
log = structlog.get_logger("ragline.api")


class BudgetRequest(BaseModel):
    model_config = STRICT_INPUT
    max_llm_calls: Int = Field(50, ge=1)
    max_tokens: Int = Field(200_000, ge=1)
    max_seconds: float = Field(3600, gt=0, allow_inf_nan=False)  # NaN was told "should be greater than 0"


class AgentRequest(BaseModel):
    model_config = STRICT_INPUT
    goal: str = Field(min_length=1, max_length=4000, pattern=NOT_BLANK)
    collection: str = Field("default", pattern=COLLECTION_PATTERN)
    max_depth: Int = Field(3, ge=0)
    budget: BudgetRequest = BudgetRequest()


def _digests(req: AgentRequest) -> tuple[str, tuple[str, ...]]:
    """The digest of the request, and those of its other spellings. Its seconds are digested as sent 3600 and
    left out alike (the default is the int 3600, while a sent number is validated into the float 3600.0): the
    budget written out with its defaults is the request without it. Jobs recorded before digested a sent
    number as the float, and still answer it."""
    sent = req.model_dump()
    seconds = float(sent["budget"]["max_seconds"])
    spelt = [{**sent, "budget": {**sent["budget"], "max_seconds": number}}
             for number in ((int(seconds), seconds) if seconds.is_integer() else (seconds,))]
    digest, *same = (request_digest("agent", spelling) for spelling in spelt)
    return digest, tuple(same)


def _shown(number: float) -> str:
    # An int of any size as it was sent: ":g" would make it a float, which overflows past ~1e308.
    return f"{number:g}" if isinstance(number, float) else str(number)


@router.post("/v1/agents", status_code=202, summary="Start an agent; answers at once with a job",
             response_description=ACCEPTED,
             responses=error_responses({422: f"{INVALID_REQUEST}, invalid_collection, over_ceiling, goal_too_long, "
                                             "idempotency_key_reused", 503: TEMPORAL_DOWN}))
async def start_agent(req: AgentRequest, request: Request, client: ClientDep, caller: CallerDep,
                      settings: SettingsDep, timeout: RpcTimeoutDep,
                      idempotency_key: IdempotencyKeyDep = None) -> AgentAccepted:
    validate_collection(req.collection)
    if (too_long := too_long_a_goal(req.goal, settings)) is not None:  # its plans would not fit the model
        raise ApiError(422, "goal_too_long", too_long, field="goal")
    ceilings = {"max_depth": (req.max_depth, settings.agent_max_depth),
                "budget.max_llm_calls": (req.budget.max_llm_calls, settings.agent_max_llm_calls),
                "budget.max_tokens": (req.budget.max_tokens, settings.agent_max_tokens),
                "budget.max_seconds": (req.budget.max_seconds, settings.agent_max_seconds)}
    over = [f"{name} {_shown(value)} > {_shown(limit)}" for name, (value, limit) in ceilings.items() if value > limit]
    if over:
        raise ApiError(422, "over_ceiling", "above the server's ceiling: " + "; ".join(over), limits={
            name: limit for name, (_, limit) in ceilings.items()})
    name = key_digest(idempotency_key) if idempotency_key is not None else uuid.uuid4().hex[:16]
    job_id = workflow_id(caller.tenant, f"agent-{name}")
    starting(request, job_id)
    digest, same = _digests(req)
    duplicate = await start_once(
        client, AgentWorkflow.run,
        AgentInput(tenant=caller.tenant, goal=req.goal, collection=req.collection, max_depth=req.max_depth,
                   budget=Budget(**req.budget.model_dump()), review_timeout_seconds=review_timeout_seconds(settings)),
        id=job_id, key=idempotency_key, digest=digest, same=same, rpc_timeout=timeout,
        task_queue=settings.task_queue, priority=caller.priority,
        search_attributes=TypedSearchAttributes([
            SearchAttributePair(sa.JOB_KIND, "agent"), SearchAttributePair(sa.JOB_STATUS, "queued"),
            SearchAttributePair(sa.COLLECTION, req.collection), SearchAttributePair(sa.TENANT, caller.tenant)]))
    if not duplicate:
        observability.job_accepted("agent")
    return AgentAccepted.for_job(request, job_id, duplicate=duplicate)


# Jobs waiting for a review, and chat turns parked while their review waits, listed at most (each read once).
REVIEWS_LISTED = 500


@router.get("/v1/reviews", summary="Everything waiting for a human review",
            responses=error_responses({503: TEMPORAL_DOWN}))
async def list_reviews(client: ClientDep, caller: CallerDep, timeout: RpcTimeoutDep) -> ReviewList:
    # One more than shown of each listing: whether more wait than the list shows.
    waiting, parked = await asyncio.gather(
        job_views.list_jobs(client, job_views.list_query(caller.tenant, status="waiting_review"),
                            REVIEWS_LISTED + 1, timeout),
        job_views.list_jobs(client, job_views.list_query(caller.tenant, status="dead_lettered", kind="chat"),
                            REVIEWS_LISTED + 1, timeout))
    more = len(waiting) > REVIEWS_LISTED or len(parked) > REVIEWS_LISTED
    waiting, parked = waiting[:REVIEWS_LISTED], parked[:REVIEWS_LISTED]
    # A chat turn's review can be pending while the summary run beside it waits for an operator: the job then
    # shows as dead_lettered, and its memo says a review waits (read from the listing, no query per job).
    executions = waiting + [e for e in parked if await _review_pending(e)]

    unreadable: list[str] = []

    async def item(execution) -> ReviewItem | None:
        try:
            request = await client.get_workflow_handle(execution.id).query("review_request", rpc_timeout=timeout)
        except WorkflowQueryFailedError as exc:
            # It ended a moment ago, or it runs and its worker cannot answer (its workflow task fails: a
            # codec key it lacks, say): then its review still waits, and the list says so.
            if await _still_runs(execution.id):
                log.warning("review request unreadable", job_id=execution.id, error=str(exc))
                unreadable.append(execution.id)
            return None
        except RPCError as exc:  # no worker answered in time: the review still waits, say so
            log.warning("review request unreadable", job_id=execution.id, error=str(exc))
            unreadable.append(execution.id)
            return None
        if not request:
            return None  # decided a moment ago; visibility has not caught up
        item = ReviewItem(job_id=execution.id, workflow_id=execution.id,
                          kind=execution.typed_search_attributes.get(sa.JOB_KIND), **request)
        # A held answer is for reviewers' eyes: a member sees that it waits, not what it says.
        return item if caller.is_reviewer else item.model_copy(update=item.as_a_member_sees())

    async def _still_runs(workflow_id: str) -> bool:
        try:
            desc = await job_views.describe_or_none(client, workflow_id, timeout)
        except RPCError:
            return True  # not known to have ended
        return desc is not None and desc.status not in job_views.ENDED

    reviews = [i for i in await job_views.gather_reads(item(e) for e in executions) if i]
    return ReviewList(reviews=reviews, unreadable=sorted(unreadable), more=more)


async def _review_pending(execution) -> bool:  # noqa: ANN001 - a listed WorkflowExecution
    try:
        return bool((await execution.memo()).get(REVIEW_PENDING_MEMO))
    except Exception:  # noqa: BLE001 - a payload this API cannot decode (another codec key)
        return False


@router.post("/v1/jobs/{job_id}/review", summary="Approve, reject or revise what a job waits on",
             responses=error_responses({403: "forbidden", 404: "job_not_found",
                                        409: "not_waiting_for_review, job_closed, job_stuck, job_not_started",
                                        422: f"{INVALID_REQUEST}, invalid_review", 503: TEMPORAL_DOWN}))
@audited("review")
async def review_job(job_id: JOB_ID, decision: ReviewDecision, client: ClientDep, caller: CallerDep,
                     settings: SettingsDep, timeout: RpcTimeoutDep,
                     idempotency_key: IdempotencyKeyDep = None) -> ReviewResult:
    """Needs a reviewer key. Recorded in the audit log with the key that decided."""
    scoped_id = scoped(caller.tenant, job_id)
    with audit.recorded(settings, action="review", job_id=job_id, decision=decision.decision,
                        reviewer=decision.reviewer, comment=decision.comment or None, **caller.on_record):
        reviewer_only(caller)  # in the block: a member's try is audited too
        decision = decision.model_copy(update={"key": caller.name})  # who decided, whatever name was typed
        # The id as asked: an error names the job the caller sent, not its scoped form.
        ack = await job_views.send_update(
            client, caller.tenant, job_id, "review", decision, ReviewAck, timeout,
            refused_code="not_waiting_for_review", kinds=("agent", "chat"),
            update_id=decision_id("review", idempotency_key, decision.model_dump(mode="json")))
    return ReviewResult(job_id=scoped_id, **ack.model_dump())
