"""Chat: one durable workflow per session, one child job per turn.

ChatSessionWorkflow (id session-<session_id>)
  update `submit`: numbers the turn in acceptance order, dedupes Idempotency-Keys, starts the turn's
                   job (queued until its go), answers at once
  loop: for each turn in order -> signal `proceed` with recent history -> await its result
  continue-as-new when history grows (state carried: counter, keys, pending turns, recent history)

ChatTurnWorkflow (id chat-<session_id>-<turn>)
  wait for `proceed` -> retrieve_context -> (summarize_context || extract_entities) -> generate_answer
"""

from __future__ import annotations

import asyncio
from collections import deque
from datetime import timedelta

from temporalio import workflow
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.contrib.workflow_streams import WorkflowStream
from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError, WorkflowAlreadyStartedError

with workflow.unsafe.imports_passed_through():
    from activities.models import AwaitTurnInput, AwaitTurnOutput
    from activities.chat_models import (
        ContextInput, EntitiesOutput, GenerateInput, GenerateOutput, HistoryItem, RetrieveInput, RetrieveOutput,
        SummaryOutput,
    )
    from temporal import policies
    from temporal import search_attributes as sa
    from workflows.models import (
        JobProgress, PendingTurn, SessionState, TurnAccepted, TurnContext, TurnInput, TurnRequest, TurnResult, Usage,
        turn_job_id,
    )
    from workflows.review import ReviewHandlers, Reviews
    from workflows.steps import OperatorHandlers, Steps, failure_reason, failure_type

HISTORY_TURNS = 4           # recent turns given to the model
HISTORY_ANSWER_CHARS = 600  # each kept answer is cut to this, so state stays small
MAX_KEYS = 1000             # Idempotency-Keys remembered per session
TURNS_PER_RUN = 200         # continue-as-new after this many turns even if the server does not ask


@workflow.defn
class ChatTurnWorkflow(OperatorHandlers, ReviewHandlers):
    def __init__(self) -> None:
        self.stream = WorkflowStream()
        self.steps = Steps(self.stream, ["retrieve_context", "summarize_context", "extract_entities",
                                         "generate_answer"])
        self.reviews = Reviews(self.steps)
        self.context: TurnContext | None = None

    @workflow.signal
    def proceed(self, context: TurnContext) -> None:
        self.context = context

    @workflow.query
    def progress(self) -> JobProgress:
        return self.steps.view()

    @workflow.run
    async def run(self, turn: TurnInput) -> TurnResult:
        self.steps.emit("ragline.job.accepted", {"session_id": turn.session_id, "turn": turn.turn})
        await workflow.wait_condition(lambda: self.context is not None)
        try:
            result = await self._chain(turn)
            if turn.require_review or (turn.review_unsupported and not result.citations):
                result = await self._hold_for_review(turn, result)
        except (ActivityError, ApplicationError) as exc:
            self.steps.skip_pending()
            reason = failure_reason(exc)
            await self.steps.finish("ragline.job.failed", {"error": reason})
            raise ApplicationError(reason, type=failure_type(exc), non_retryable=True) from exc
        await self.steps.finish("ragline.job.completed", result.model_dump(mode="json"))
        return result

    async def _hold_for_review(self, turn: TurnInput, result: TurnResult) -> TurnResult:
        """The answer waits for a person, who may release it, replace its text, or reject it."""
        reason = "review requested" if turn.require_review else "answer without a supporting citation"
        decision = await self.reviews.ask(
            reason=reason, detail=f"answer to {turn.message[:200]!r} is held until a reviewer releases it",
            proposed_action={"action": "release_answer", "answer": result.answer[:2000]}, goal=turn.message,
            depth=0, timeout=timedelta(seconds=turn.review_timeout_seconds))
        if decision.decision == "reject":
            raise ApplicationError(f"answer rejected by {decision.reviewer}: {decision.comment or 'no comment'}",
                                   type="AnswerRejected", non_retryable=True)
        released = decision.answer or result.answer
        return result.model_copy(update={"answer": released, "review": self.reviews.history[-1]})

    async def _chain(self, turn: TurnInput) -> TurnResult:
        retrieved = await self.steps.run("retrieve_context", lambda: workflow.execute_activity(
            "retrieve_context", RetrieveInput(question=turn.message, collection=turn.collection, top_k=turn.top_k),
            result_type=RetrieveOutput, **policies.options("retrieve_context")))
        context = ContextInput(question=turn.message, context_ref=retrieved.context_ref)
        summary, entities = await asyncio.gather(
            self.steps.run("summarize_context", lambda: workflow.execute_activity(
                "summarize_context", context, result_type=SummaryOutput, **policies.options("summarize_context"))),
            self.steps.run("extract_entities", lambda: workflow.execute_activity(
                "extract_entities", context, result_type=EntitiesOutput, **policies.options("extract_entities"))))
        answer = await self.steps.run("generate_answer", lambda: workflow.execute_activity(
            "generate_answer", GenerateInput(
                question=turn.message, context_ref=retrieved.context_ref, summary=summary.summary,
                entities=entities.entities,
                history=[HistoryItem(**h) for h in (self.context.history if self.context else [])]),
            result_type=GenerateOutput, **policies.options("generate_answer")))
        citations = [retrieved.citations[i - 1].model_dump() for i in answer.cited if i <= len(retrieved.citations)]
        return TurnResult(
            session_id=turn.session_id, turn=turn.turn, question=turn.message, answer=answer.answer,
            citations=citations, summary=summary.summary, entities=[e.model_dump() for e in entities.entities],
            model=answer.model, warnings=entities.warnings,
            usage=Usage(prompt_tokens=summary.prompt_tokens + entities.prompt_tokens + answer.prompt_tokens,
                        completion_tokens=summary.completion_tokens + entities.completion_tokens
                        + answer.completion_tokens))


@workflow.defn
class ChatSessionWorkflow:
    @workflow.init
    def __init__(self, state: SessionState) -> None:
        self.state = state
        self.queue: deque[PendingTurn] = deque(state.pending)
        # Handles of turn jobs this run started; a turn inherited through continue-as-new has none.
        self.children: dict[int, asyncio.Future] = {}
        self.turns_this_run = 0

    @workflow.update
    async def submit(self, req: TurnRequest) -> TurnAccepted:
        key = req.idempotency_key
        if key and key in self.state.keys:
            return self.state.keys[key].model_copy(update={"duplicate": True})
        turn = self.state.next_turn
        self.state.next_turn += 1
        accepted = TurnAccepted(job_id=turn_job_id(self.state.session_id, turn), turn=turn)
        if key:
            self.state.keys[key] = accepted
            while len(self.state.keys) > MAX_KEYS:
                self.state.keys.pop(next(iter(self.state.keys)))
        # Queued before any await, so turns run in the order they were accepted.
        pending = PendingTurn(turn=turn, job_id=accepted.job_id, message=req.message)
        self.queue.append(pending)
        # The turn's job is started by the same workflow task that completes this update, but the
        # answer does not wait for the server to confirm the start: one round trip less before 202.
        # (GET /v1/jobs covers the few milliseconds in between from the session's queue.)
        self.children[turn] = asyncio.ensure_future(self._start_turn(pending, req))
        return accepted

    @workflow.query
    def pending_turns(self) -> list[PendingTurn]:
        return list(self.queue)

    async def _start_turn(self, pending: PendingTurn, req: TurnRequest) -> workflow.ChildWorkflowHandle | None:
        try:
            return await workflow.start_child_workflow(
                ChatTurnWorkflow.run,
                TurnInput(session_id=self.state.session_id, turn=pending.turn, message=req.message,
                          collection=req.collection, top_k=req.top_k, require_review=req.require_review,
                          review_unsupported=req.review_unsupported,
                          review_timeout_seconds=req.review_timeout_seconds),
                id=pending.job_id, parent_close_policy=workflow.ParentClosePolicy.ABANDON,
                memo={"turn": pending.turn, "message": req.message[:500]},
                search_attributes=TypedSearchAttributes([
                    SearchAttributePair(sa.JOB_KIND, "chat"),
                    SearchAttributePair(sa.JOB_STATUS, "queued"),
                    SearchAttributePair(sa.COLLECTION, req.collection),
                    SearchAttributePair(sa.SESSION, self.state.session_id),
                ]))
        except WorkflowAlreadyStartedError:
            return None  # a turn number used by an earlier run of this session id: awaited by id instead

    @workflow.run
    async def run(self, state: SessionState) -> None:
        while True:
            await workflow.wait_condition(lambda: bool(self.queue) or self._should_continue_as_new())
            if not self.queue:
                await workflow.wait_condition(workflow.all_handlers_finished)
                await asyncio.gather(*self.children.values())
                if not self.queue:
                    self.state.pending = []
                    workflow.continue_as_new(self.state)
                continue
            head = self.queue[0]
            child = await self.children[head.turn] if head.turn in self.children else None
            answer = await self._run_turn(head, child)
            if answer is not None:
                self.state.history.append({"question": head.message[:HISTORY_ANSWER_CHARS],
                                           "answer": answer[:HISTORY_ANSWER_CHARS]})
                del self.state.history[:-HISTORY_TURNS]
            self.queue.popleft()
            self.children.pop(head.turn, None)
            self.turns_this_run += 1

    async def _run_turn(self, head: PendingTurn, child: workflow.ChildWorkflowHandle | None) -> str | None:
        """Give the turn its go and wait for it; the answer, or None when the turn failed."""
        context = TurnContext(history=self.state.history[-HISTORY_TURNS:])
        if child is not None:
            await child.signal(ChatTurnWorkflow.proceed, context)
            try:
                return (await child).answer
            except ChildWorkflowError:
                return None
        await workflow.get_external_workflow_handle(head.job_id).signal(ChatTurnWorkflow.proceed, context)
        outcome = await workflow.execute_activity(
            "await_turn", AwaitTurnInput(workflow_id=head.job_id), result_type=AwaitTurnOutput,
            **policies.options("await_turn"))
        return outcome.answer

    def _should_continue_as_new(self) -> bool:
        return self.turns_this_run >= TURNS_PER_RUN or workflow.info().is_continue_as_new_suggested()
