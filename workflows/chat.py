"""Chat: one durable workflow per session orders the turns; one job per turn answers it.

POST /v1/chats --signal-with-start `submit`--> ChatSessionWorkflow (id session-<session_id>)
  on submit: number the turn in acceptance order (the order of the signals in history), skip a job id
             seen before, start the turn's job at once (it waits, queued, for its go)
  loop:      for each turn in order -> signal `proceed` with the recent history -> await its answer (its
             summary and entities may still run: a later turn waiting asks for the answer as soon as it is final)
  continue-as-new at a turn boundary, or while the head turn waits (a reviewer holds it) once the run has
             grown long; carried: turn counter, recent job ids, turns not yet run (the head too), history
  full (RAGLINE_SESSION_MAX_QUEUED_TURNS turns not yet answered): a message is not numbered or queued; its
             job starts only to fail at once (SessionBusy)
  idle ([sessions] idle, no turn to run): ends, returning what it would carry; the API starts it again for
             the next message with the ended run's id, and the new run takes that result up (session_left)
             before it numbers any turn

ChatTurnWorkflow (id chat-<session_id>.<digest of session and Idempotency-Key>)
  wait for `proceed` -> retrieve_context (meanwhile: ask for a running slot of the tenant, workflows/slot.py)
  -> [the slot] -> generate_answer (streams deltas) -> summarize_context || extract_entities
  Only when the passages overflow the model's context budget does summarize_context run before
  generate_answer, which then answers from the summary. Nothing else delays the answer's first token.
  A held answer (require_review, or RAGLINE_REVIEW_UNSUPPORTED_ANSWERS and no citation) is put to its
  reviewer right after generate_answer, while the side steps run: released, it is shown and told to the
  session at once; rejected, the side steps are cancelled. One that cites a passage is shown at once.
  Its step events ride along with the events a person waits for (the deltas, the answer, the end), except
  while that summary runs: a person then sees the turn at work.
  On a model endpoint with no more slots than the two side steps (a local model), the next question's answer
  would wait for them: once the session has this answer (its next turn goes), they stop, and what was left of
  them runs once that turn says its answer step has ended (signal `later_answer_out`; [sessions] step_aside).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDReusePolicy
from temporalio.exceptions import (
    ActivityError, ApplicationError, ChildWorkflowError, FailureError, WorkflowAlreadyStartedError,
    is_cancelled_exception,
)

with workflow.unsafe.imports_passed_through():
    from activities.chat import ChatActivities, marked_passages, quote_for
    from activities.jobs import JobActivities
    from models.chat import (
        AwaitTurnInput, CacheInput, Citation, ContextInput, EntitiesOutput, GenerateInput, GenerateOutput, HistoryItem,
        FINAL_ANSWER_DETAIL, KEY_EXPIRED, KEY_EXPIRED_TYPE, SESSION_ENDED, SIDE_STEPS, RetrieveInput, SessionLeft,
        SessionRun, SessionState, SummaryOutput, TurnAnswered, TurnContext, TurnInput, TurnResult, Usage, session_busy,
        session_workflow_id,
    )
    from models.jobs import ANSWERED_MEMO, REQUEST_MEMO, REVIEW_PENDING_MEMO
    from models.review import ReviewDecision, without
    from ragline import tracing
    from temporal import policies
    from temporal import search_attributes as sa
    from temporal.errors import failure_detail
    from workflows.job import ENDED, JobWorkflow
    from workflows.review import ReviewHandlers

# Turns recorded before a reviewer's hold kept the answer out of the stream replay showing it at once.
REVIEW_HOLDS_ANSWER_PATCH = "review-holds-answer"
# Turns recorded before a summary the answer waits for showed the turn's steps at once replay with them
# held until the first delta.
SUMMARY_SHOWN_PATCH = "summary-first-shows-steps"
# An answer its step warns about (the model looped, it was cut) is not cached. Earlier code cached it,
# and a turn whose step ran on a newer worker than its workflow task did must replay so.
WARNED_ANSWER_NOT_CACHED_PATCH = "warned-answer-not-cached"
# A turn whose answer a reviewer may hold shows its steps as they happen; earlier, with the answer.
HELD_ANSWER_SHOWS_STEPS_PATCH = "held-answer-shows-steps"
# A model reply with no words ("[1] [2]") is told by its own warning, not also as "unverified". Earlier
# turns warned both.
NO_ANSWER_NOT_UNVERIFIED_PATCH = "no-answer-not-unverified"
# A reviewer's replacement text is released with the citations of its own [n] markers and without what the
# turn told about the model's answer. Earlier turns released it with the model answer's citations,
# `supported` and warnings.
REVIEWER_ANSWER_PATCH = "reviewer-answer-cites-its-own-markers"
# A held answer's review lists the turn's passages numbered as the model saw them, so a reviewer's own [n]
# markers can name them. Earlier reviews showed the answer alone.
REVIEW_PASSAGES_PATCH = "review-lists-numbered-passages"
# A refusal a reviewer may hold is not cached before the review (a rejected one was served from the cache
# to the next asker). Earlier turns cached it at once.
HELD_REFUSAL_PATCH = "held-refusal-not-cached"
# A session gives its next turn the go once the turn before has its answer, not once that turn's summary and
# entities are done too. Earlier sessions waited for the whole job. Both workflow types check it (the session
# before it asks, the turn before it tells): retire it in both together.
NEXT_TURN_AFTER_ANSWER_PATCH = "next-turn-after-answer"
# A held answer is put to its reviewer while the summary and entities run, and shown once released. Earlier
# turns asked the reviewer only after both had ended.
REVIEW_BESIDE_SIDE_STEPS_PATCH = "review-beside-side-steps"
# A side step that fails for good (discarded, or parked past its TTL) while its held answer waits for review
# fails the turn at once and withdraws the review. Earlier turns went on waiting for a decision that could
# no longer change the outcome: an approval showed the answer and the job failed right after.
SIDE_STEP_FAILURE_ENDS_REVIEW_PATCH = "side-step-failure-ends-review"
# When the summary or the entities fail for good, the other is stopped (its model call, or its wait for an
# operator). Earlier turns left it running in a failed job.
SIDE_STEPS_STOP_TOGETHER_PATCH = "side-steps-stop-together"
# A turn that fails once its answer was shown (its summary or entities failed for good) leaves that answer in
# its session's history, as it does when a later turn asked for it before the end (its failure carries it).
# Earlier sessions kept it only in that case. (A cancelled turn's still depends on it: its cancel carries none.)
FAILED_TURN_ANSWER_PATCH = "failed-turn-shown-answer-in-history"
# A turn waiting for its session's go checks now and then that the session still runs: one terminated by hand
# gives no go, and the turn failed (SessionEnded) instead of waiting for ever. Earlier turns waited.
GO_WATCHES_SESSION_PATCH = "turn-waiting-for-its-go-watches-its-session"
# A turn cancelled once its answer was shown (during its summary and entities) tells its session that answer,
# which the next turn is asked with. Earlier turns told it only when a later turn had asked; otherwise the
# session saw a cancelled job and dropped the answer from the history. Both workflow types check it (the turn
# before it tells, the session before it reads what it was told at the turn's end): retire it in both together.
CANCELLED_TURN_ANSWER_PATCH = "cancelled-turn-tells-its-shown-answer"
# A turn cancelled while the answer a later turn asked for is on its way to the session waits for it to land
# (the server drops a signal its closed sender had not delivered yet). Earlier turns ended at once.
CANCELLED_TURN_WAITS_FOR_ITS_ANSWER_PATCH = "cancelled-turn-waits-for-its-answer-sent"
# A session with no turn to run for [sessions] idle ends, its state its result; the API starts it again for
# a later message, from what that run left. Earlier sessions waited for ever.
SESSION_ENDS_IDLE_PATCH = "session-ends-when-idle"
# A session whose run grew long (the server suggests continue-as-new, or [submits_per_run] messages came)
# while its head turn waits (a reviewer holds it) continues as new then, carrying that turn too. Earlier
# sessions waited for the turn's end: messages sent meanwhile grew the run towards the server's limits.
SESSION_CONTINUES_MID_TURN_PATCH = "session-continues-as-new-while-its-turn-waits"
# A session holding RAGLINE_SESSION_MAX_QUEUED_TURNS turns not yet answered refuses the next (SessionBusy).
# Earlier sessions queued every turn (an older API's turn carries no bound; a newer one's, replayed, must not).
SESSION_REFUSES_PATCH = "session-refuses-past-its-bound"
# A keyed turn sent again that names a job this session started and no longer holds (gone past the retention:
# the API found no job) gets a job that fails at once saying so; earlier sessions dropped it, and the person's
# 202 named a job that never came.
RESENT_AFTER_GONE_PATCH = "resent-turn-whose-job-is-gone-fails-saying-so"
# A turn a run did not start (carried over a continue-as-new) is asked for its answer when a later turn
# waits, as a started one is; earlier runs waited for its whole job (its summary and entities too).
CARRIED_TURN_ASKED_PATCH = "carried-turn-asked-for-its-answer"
# A refusal ("no passage answers this") no reviewer holds is final once shown: the session hears it then, as it
# hears a model's answer. Earlier turns told it only at their end, after their cache write (which could park).
REFUSAL_TOLD_PATCH = "refusal-told-to-its-session-once-shown"
# On a small model endpoint, a turn whose session has heard its answer (a later turn goes next) stops its summary
# and entities, which the later answer would wait for, and runs what was left of them once told that answer is
# out. Earlier turns ran them on. Asked only by turns whose answer step said how small the endpoint is.
STEP_ASIDE_PATCH = "side-steps-step-aside-for-a-later-answer"
# A turn given the job of the turn before (`TurnContext.before`) tells it once its own answer step has ended.
# Earlier turns sent nothing (their contexts named no job).
TELLS_TURN_BEFORE_PATCH = "turn-tells-the-turn-before-its-answer-is-out"
STEPPED_ASIDE = "stopped while the next question's answer uses the model; runs again once that answer is out"
RAN_AGAIN = "stopped for the next question's answer, then run again"
SESSION_CHECK_AT_MOST_EVERY = timedelta(hours=1)  # from [sessions] check, doubled after each look
UNVERIFIED_WARNING = "the answer cites no passage and no passage supports it: treat it as unverified"
HISTORY_TURNS = 4           # recent turns given to the model
HISTORY_ANSWER_CHARS = 600  # each kept answer is cut to this, so state stays small
MAX_SEEN = 1000             # job ids remembered per session, to skip a resent request


@workflow.defn
class ChatTurnWorkflow(JobWorkflow, ReviewHandlers):
    # cache_answer is not planned: it shows as a step only when it runs (turns without history).
    PLANNED = (ChatActivities.retrieve_context, ChatActivities.generate_answer, ChatActivities.summarize_context,
               ChatActivities.extract_entities)

    def __init__(self) -> None:
        super().__init__()
        self.context: TurnContext | None = None
        # A reviewer may hold this turn's answer: it is shown (streamed, `answer.completed`) only once
        # released. What `answer.completed` will carry waits here meanwhile.
        self._answer_held = False
        self._held_answer: dict | None = None
        # The turn's retrieved passages as citations, numbered as the model saw them ([1] first), and what
        # the turn tells about the model's answer: a reviewer's replacement text is cited against the
        # former and does not carry the latter.
        self._passages: list[Citation] = []
        self._model_answer_warnings: list[str] = []
        self.reviews.revise_needs_answer = True  # a chat turn is revised by giving the text to release
        self._follow_up_waits = False
        self._final_answer: str | None = None
        # The signal that gives the session this turn's final answer: sent, and settled (delivered, or the
        # session gone). A cancel waits for a sent one to settle: the server drops what a closed workflow had
        # not yet delivered.
        self._session_told = False
        self._telling_settled = False
        self._turn: TurnInput | None = None
        self._shown: dict | None = None  # `ragline.answer.completed`'s data, once emitted
        self._later_answer_out = False  # the session's next turn has had its answer step
        self._steps_aside = False  # its side steps stop for the next turn's answer once the session has this one

    @workflow.signal
    def proceed(self, context: TurnContext) -> None:
        self.context = context

    @workflow.signal
    def follow_up_waits(self) -> None:
        """From the session: a later turn waits for this one's answer, which it is told once final."""
        self._follow_up_waits = True

    @workflow.signal
    def later_answer_out(self) -> None:
        """From the session's next turn: its answer step has ended, so side steps set aside for it run again."""
        self._later_answer_out = True

    @workflow.run
    async def run(self, turn: TurnInput) -> TurnResult:
        self._turn = turn
        return await self.run_job(lambda: self._answer(turn),
                                  accepted={"session_id": turn.session_id, "turn": turn.turn or None},
                                  ready=lambda: self._go(turn))

    SLOT_BEFORE_WORK = False  # retrieval (no model call) runs while the slot is asked for
    HOLD_STEP_EVENTS = True   # a stream read fewer for each step: the person waits for the answer

    def takes_slot(self) -> bool:
        return True  # its parent, the session, holds no running slot

    async def _go(self, turn: TurnInput) -> None:
        """The session's go: this turn is next in its session (the context came with the start when idle)."""
        if turn.refused is not None:  # its session was full: it never takes a turn
            raise ApplicationError(turn.refused, type=turn.refused_type or "SessionBusy", non_retryable=True)
        self.context = self.context or turn.context
        if self.context is None:
            self.events.release()  # earlier turns of the session go first: `accepted` says which turn this is
        parent = workflow.info().parent
        if self.context is None and parent is not None and workflow.patched(GO_WATCHES_SESSION_PATCH):
            await self._go_while_session_runs(SessionRun(workflow_id=parent.workflow_id, run_id=parent.run_id))
        await workflow.wait_condition(lambda: self.context is not None)

    async def _go_while_session_runs(self, session: SessionRun) -> None:
        """Waits for the go, looking now and then (ever less often: a turn may wait days behind one whose
        answer a reviewer holds) whether the session still runs to give it."""
        every = policies.session_check()
        while True:
            try:
                await workflow.wait_condition(lambda: self.context is not None, timeout=every)
                return
            except asyncio.TimeoutError:
                pass
            try:
                checked = await policies.execute(JobActivities.session_still_runs, session)
            except ActivityError as exc:
                if is_cancelled_exception(exc):  # the turn was cancelled meanwhile
                    raise
                # Temporal out of reach: no sign that the session ended.
                workflow.logger.warning("could not check the session (next try later): %s", exc)
            else:
                if not checked.running and self.context is None:
                    raise ApplicationError(SESSION_ENDED, type="SessionEnded", non_retryable=True)
                # The chain is known from now on, for when the run that started this turn is gone (the retention).
                session = session.model_copy(update={"first_run_id": session.first_run_id or checked.first_run_id})
            every = min(every * 2, SESSION_CHECK_AT_MOST_EVERY)

    async def _answer(self, turn: TurnInput) -> TurnResult:
        self._answer_held = (turn.question.require_review or turn.review_unsupported) and \
            workflow.patched(REVIEW_HOLDS_ANSWER_PATCH)
        if self._answer_held and workflow.patched(HELD_ANSWER_SHOWS_STEPS_PATCH):
            # No answer delta will carry the step events along (a held answer is not streamed): each goes
            # out as it happens, or the person would see nothing until the review, minutes on a local model.
            self.events.hold_steps = False
            self.events.release()
        try:
            result = await self._chain(turn)
        except ENDED:  # failed or cancelled before its answer: the turn before need not wait [sessions] step_aside
            if (telling := self._tell_turn_before()) is not None:
                await telling  # sent before the job ends
            raise
        if self._needs_review(turn, result) and result.review is None:  # not already reviewed beside the side steps
            result = await self._hold_for_review(turn, result)
        if self._held_answer is not None:  # released (or never held after all): the person sees it now
            self._shown = self._released(result)
            self.events.emit("ragline.answer.completed", self._shown)
        return result

    def shown_answer(self) -> dict | None:
        return self._shown

    def failure_details(self) -> dict[str, Any]:
        return {FINAL_ANSWER_DETAIL: self._final_answer[:HISTORY_ANSWER_CHARS]} if self._final_answer else {}

    def _released(self, result: TurnResult) -> dict:
        """`ragline.answer.completed` of a held answer: a reviewer's text comes with its own citations."""
        shown = {**self._held_answer, "answer": result.answer}
        if result.written_by_reviewer:  # set from REVIEWER_ANSWER_PATCH on only: older turns replay as they ran
            shown.update(citations=[c.model_dump(mode="json") for c in result.citations], supported=result.supported,
                         written_by_reviewer=True)
        return shown

    def shown_result(self, result: TurnResult) -> dict:
        """A reviewed answer's review as every key of the tenant may read it: without what it withheld."""
        shown = result.model_dump(mode="json")
        if result.review is not None and result.review.withheld:
            shown["review"]["proposed_action"] = without(result.review.proposed_action, result.review.withheld)
        return shown

    @staticmethod
    def _needs_review(turn: TurnInput, result: TurnResult) -> bool:
        return turn.question.require_review or (turn.review_unsupported and not result.citations)

    def _show_answer(self, data: dict) -> None:
        """`ragline.answer.completed`, before the side steps; held back while a reviewer may hold the answer."""
        if self._answer_held:
            self._held_answer = data
        else:
            self._shown = data
            self.events.emit("ragline.answer.completed", data)

    async def _chain(self, turn: TurnInput) -> TurnResult:
        question = turn.question
        # A question asked without conversation history means the same to everyone: the answer cache
        # (looked up inside retrieval, no extra round trip) may serve it.
        use_cache = not self.context.history
        retrieved = await self.step(ChatActivities.retrieve_context, RetrieveInput(
            tenant=turn.tenant, question=question.message, collection=question.collection, top_k=question.top_k,
            use_cache=use_cache, follows=self.context.history[-1].question if self.context.history else None))
        self._passages = retrieved.citations
        if retrieved.cached is not None or not retrieved.supported:
            self._tell_turn_before()  # no model call for this answer
        if retrieved.cached is not None:
            result = retrieved.cached.model_copy(update={
                "session_id": turn.session_id, "turn": turn.turn, "question": question.message, "cached": True,
                "usage": retrieved.cached.usage.model_copy(update={"prompt_tokens": 0, "completion_tokens": 0}),
                "review": None})
            self.steps.skip_pending()
            return self._answered(result)
        if not retrieved.supported:
            result = TurnResult(session_id=turn.session_id, turn=turn.turn, question=question.message,
                                answer=retrieved.refusal or "", citations=[], summary="", entities=[], model="none",
                                usage=Usage(), supported=False, warnings=list(retrieved.warnings), answered=False)
            if self._answer_held and self._needs_review(turn, result) and workflow.patched(HELD_REFUSAL_PATCH):
                shown = self._answered(result)  # not cached: a reviewer may still reject it
                self.steps.skip_pending()
                return shown
            shown = self._answered(result)
            if not self._needs_review(turn, result) and workflow.patched(REFUSAL_TOLD_PATCH):
                self._tell_session(turn, "")  # no answer: nothing for the session's history
            return await self._remember(shown, retrieved.cache_key)
        # The model calls from here on are what the tenant's running slot is for; retrieval ran while
        # the slot was being asked for.
        await self.running_slot()
        context = ContextInput(question=question.message, context_ref=retrieved.context_ref)
        summary = None if retrieved.fits else await self._summary_shown_while_it_runs(context)
        generate = GenerateInput(question=question.message, context_ref=retrieved.context_ref,
                                 history=self.context.history, summary=summary.summary if summary else None,
                                 stream=not self._answer_held)

        fell_back = []

        def numbered_on(arg: GenerateInput, _failure: Any = None) -> GenerateInput:
            """A new generation of the answer (the fallback's, an operator's retry): its deltas' attempt follows
            every attempt made before it. It began at 1 again, and a client that starts the answer over when the
            attempt changes showed the new one after the old one's first pieces."""
            return arg.model_copy(update={"attempts_before": sum(
                self.steps.attempts(policies.activity_name(a))
                for a in (ChatActivities.generate_answer, ChatActivities.generate_answer_fallback))})

        async def fall_back():
            fell_back.append(True)
            return await self.step(ChatActivities.generate_answer_fallback, numbered_on(generate), resume=numbered_on)

        answer = await self.step(ChatActivities.generate_answer, generate, resume=numbered_on,
                                 on_exhausted=fall_back if turn.fallback else None)
        self._tell_turn_before()
        fallback_model = (answer.model or "fallback") if fell_back else None
        citations = answer.citations
        self._show_answer({"answer": answer.answer, "citations": [c.model_dump(mode="json") for c in citations]})
        if not self._answer_held:  # final: no reviewer can hold or replace it
            self._tell_session(turn, answer.answer if answer.answered else "")  # no answer: nothing for history
        told = []  # what the turn tells about the model's answer, besides what its step warned
        if not answer.grounded and not self._gave_no_answer(answer):
            told.append(UNVERIFIED_WARNING)
        if fallback_model:
            told.append(f"the configured model kept failing; answered by the fallback model {fallback_model}")
        self._model_answer_warnings = [*answer.warnings, *told]

        def turn_result(summary: SummaryOutput, entities: EntitiesOutput) -> TurnResult:
            return TurnResult(
                session_id=turn.session_id, turn=turn.turn, question=question.message, answer=answer.answer,
                citations=citations, summary=summary.summary, entities=entities.entities, model=answer.model,
                warnings=[*answer.warnings, *entities.warnings, *told],
                usage=summary.usage + entities.usage + answer.usage, supported=answer.grounded,
                fallback_model=fallback_model, answered=answer.answered)

        side_steps = self._side_steps_after_a_later_answer(context, summary, answer)
        answered = turn_result(SummaryOutput(summary=""), EntitiesOutput(entities=[]))  # before the side steps
        if self._answer_held and workflow.patched(REVIEW_BESIDE_SIDE_STEPS_PATCH):
            if self._needs_review(turn, answered):
                return await self._reviewed_beside_side_steps(turn, answered, side_steps, turn_result)
            self._release(turn, answered)  # it cites a passage: nobody need review it
        result = turn_result(*await side_steps)
        if not answer.grounded or fallback_model:
            return result  # only grounded answers of the configured model are worth repeating
        if answer.warnings and workflow.patched(WARNED_ANSWER_NOT_CACHED_PATCH):
            return result  # nor one cut short: the next asker gets a fresh answer
        if self._answer_held and self._needs_review(turn, result):
            return result  # nor one a reviewer has not released: the cache would serve it unreviewed
        return await self._remember(result, retrieved.cache_key)

    async def _side_steps(self, context: ContextInput,
                          summary: SummaryOutput | None) -> tuple[SummaryOutput, EntitiesOutput]:
        """The summary (unless the answer needed it first) and the entities: after the answer, beside each other."""
        if summary is None:
            both = (self.step(ChatActivities.summarize_context, context),
                    self.step(ChatActivities.extract_entities, context))
            if workflow.patched(SIDE_STEPS_STOP_TOGETHER_PATCH):
                return await self.together(*both)
            return await asyncio.gather(*both)
        return summary, await self.step(ChatActivities.extract_entities, context)

    async def _side_steps_after_a_later_answer(self, context: ContextInput, summary: SummaryOutput | None,
                                               answer: GenerateOutput) -> tuple[SummaryOutput, EntitiesOutput]:
        """The side steps. On an endpoint with no more model slots than they take (a local model), the next
        question's answer would wait for them: once the session has heard this answer (that question goes next),
        they stop, and what was left of them runs once told that answer is out. The running slot is lent meanwhile:
        a tenant with one could otherwise run neither turn."""
        if answer.model_slots is None or answer.model_slots > SIDE_STEPS:
            return await self._side_steps(context, summary)
        self._steps_aside = True  # the session, told the answer, has the next turn tell this one
        done: dict[str, Any] = {} if summary is None else {policies.activity_name(ChatActivities.summarize_context):
                                                           summary}
        side = [a for a in (ChatActivities.summarize_context, ChatActivities.extract_entities)
                if policies.activity_name(a) not in done]

        async def run(activity: Callable[..., Any]) -> None:
            done[policies.activity_name(activity)] = await self.step(activity, context)

        def results() -> tuple[SummaryOutput, EntitiesOutput]:
            return (done[policies.activity_name(ChatActivities.summarize_context)],
                    done[policies.activity_name(ChatActivities.extract_entities)])

        def next_goes() -> bool:  # the session heard this answer, or is about to: its next turn goes now
            return self._session_told or (self._follow_up_waits and self._final_answer is not None)

        running = None
        if not next_goes():
            running = asyncio.ensure_future(self.together(*(run(a) for a in side)))
            try:
                await workflow.wait_condition(lambda: running.done() or next_goes())
            except ENDED:  # the job's cancel, or a reviewer's rejection: it reaches the steps only through here
                await self.stop(running)
                raise
            if running.done():
                self._steps_aside = False
                await running
                return results()
        if not workflow.patched(STEP_ASIDE_PATCH):  # recorded by a worker that ran them on
            await (running or self.together(*(run(a) for a in side)))
            return results()
        if running is not None:
            await self.stop(running)
        for activity in side:
            if (name := policies.activity_name(activity)) not in done:
                self.steps.set_aside(name, STEPPED_ASIDE, RAN_AGAIN)
        async with self.slot.lent():
            try:
                await workflow.wait_condition(lambda: self._later_answer_out, timeout=policies.step_aside())
            except asyncio.TimeoutError:
                pass  # not told (that turn failed before its answer, say): they run now
        await self.together(*(run(a) for a in side if policies.activity_name(a) not in done))
        return results()

    def _tell_turn_before(self) -> asyncio.Future[None] | None:
        """The turn before, which set its side steps aside for this answer, may run them now (told once)."""
        before = self.context.before if self.context is not None else None
        if before is None or not workflow.patched(TELLS_TURN_BEFORE_PATCH):
            return None
        self.context = self.context.model_copy(update={"before": None})

        async def tell() -> None:
            try:
                await workflow.get_external_workflow_handle(before).signal(ChatTurnWorkflow.later_answer_out)
            except FailureError:
                pass  # it has ended: nothing waits

        return asyncio.ensure_future(tell())

    async def _reviewed_beside_side_steps(
            self, turn: TurnInput, answered: TurnResult, side_steps: Awaitable[tuple[SummaryOutput, EntitiesOutput]],
            turn_result: Callable[[SummaryOutput, EntitiesOutput], TurnResult]) -> TurnResult:
        """A held answer is put to the reviewer at once, while its summary and entities run: the reviewer, the
        person and the session's next turn need the answer alone. Released, it is shown (and told to the
        session) before the side steps end; rejected, they are stopped. The running slot is lent to the tenant's
        other jobs only while none of the side steps runs (they ended, or one waits for an operator)."""
        running = await self.beside(side_steps)
        workflow.upsert_memo({REVIEW_PENDING_MEMO: True})
        deciding = asyncio.ensure_future(self._review_decision(turn, answered.answer))
        let_go = False
        try:
            if workflow.patched(SIDE_STEP_FAILURE_ENDS_REVIEW_PATCH):
                await workflow.wait([deciding, running], return_when=asyncio.FIRST_COMPLETED)
                if not deciding.done() and running.exception() is not None:
                    raise running.exception()  # the turn fails whatever the reviewer would say
            decision = await deciding
        except ENDED:
            await self.stop(deciding)  # withdrawn: nothing waits for the reviewer any more
            await self.stop(running)  # rejected or cancelled: no summary of an answer nobody will see
            raise
        except GeneratorExit:
            let_go = True  # closed once its worker let go: the memo call would go to whatever workflow runs now
            raise
        finally:
            if not let_go:
                workflow.upsert_memo({REVIEW_PENDING_MEMO: None})
        self._release(turn, self._with_review(answered, decision))
        return self._with_review(turn_result(*await running), decision)

    def _release(self, turn: TurnInput, released: TurnResult) -> None:
        """A held answer the person may see now: shown, and told to the session, while the side steps run."""
        self._shown = self._released(released)
        self._held_answer = None
        self.events.emit("ragline.answer.completed", self._shown)
        self._tell_session(turn, released.answer if released.answered else "")

    def _tell_session(self, turn: TurnInput, final_answer: str) -> None:
        self._final_answer = final_answer
        asyncio.ensure_future(self._tell_session_when_asked(turn))

    async def _tell_session_when_asked(self, turn: TurnInput) -> None:
        """The final answer goes to the session if a later turn waits for it: that turn need not wait for this
        one's summary and entities. Nobody asks a turn its session has no later turn for: nothing is sent."""
        await workflow.wait_condition(lambda: self._follow_up_waits)
        # A job that heard the session's ask on an older worker (which had no handler) replays without telling.
        if not workflow.patched(NEXT_TURN_AFTER_ANSWER_PATCH):
            return
        # Read by a later turn's `waiting_for`: this one holds nothing any more.
        workflow.upsert_memo({ANSWERED_MEMO: True})
        await self._send_session_the_answer(turn)

    async def _send_session_the_answer(self, turn: TurnInput) -> None:
        self._session_told = True
        session = workflow.get_external_workflow_handle(session_workflow_id(turn.tenant, turn.session_id))
        try:
            await session.signal(ChatSessionWorkflow.turn_answered,
                                 TurnAnswered(job_id=workflow.info().workflow_id,
                                              answer=(self._final_answer or "")[:HISTORY_ANSWER_CHARS],
                                              steps_aside=self._steps_aside))
        except FailureError:
            pass  # the session has moved on: it read the answer from this job's end
        finally:
            self._telling_settled = True

    async def _cancelled(self) -> None:
        await super()._cancelled()
        # The person saw the answer: the next question of the session is asked with it. A cancel carries no
        # details for the session to read it from, so it is told before the job ends (or, if a later turn's
        # ask came with the cancel, the send it started is awaited: the job must not end while it is on its way).
        if self._final_answer and workflow.patched(CANCELLED_TURN_ANSWER_PATCH):
            if not self._session_told:
                await self._send_session_the_answer(self._turn)
            elif not self._telling_settled and workflow.patched(CANCELLED_TURN_WAITS_FOR_ITS_ANSWER_PATCH):
                await workflow.wait_condition(lambda: self._telling_settled)

    @staticmethod
    def _gave_no_answer(answer: GenerateOutput) -> bool:
        """The model's reply had no words: its step's warning says so, and there is no answer to call unverified."""
        return not answer.answered and workflow.patched(NO_ANSWER_NOT_UNVERIFIED_PATCH)

    async def _summary_shown_while_it_runs(self, context: ContextInput) -> SummaryOutput:
        """The summary the answer waits for (passages too long for the model; tens of seconds on a local
        model): its step events go out at once, and the ones held so far with them, so that the person sees
        the turn at work rather than nothing until the first delta."""
        context = context.model_copy(update={"before_answer": True})
        if not workflow.patched(SUMMARY_SHOWN_PATCH):
            return await self.step(ChatActivities.summarize_context, context)
        with self.events.shown_at_once():
            return await self.step(ChatActivities.summarize_context, context)

    def _answered(self, result: TurnResult) -> TurnResult:
        """A turn answered without the model chain: the remaining planned steps are skipped."""
        self._show_answer({"answer": result.answer, "citations": [c.model_dump(mode="json") for c in result.citations],
                           "supported": result.supported, "cached": result.cached})
        return result

    async def _remember(self, result: TurnResult, key: str | None) -> TurnResult:
        if key is not None:  # the answer is shown: a cache that cannot take it holds nothing up
            await self.step(ChatActivities.cache_answer, CacheInput(key=key, result=result), optional=True)
        self.steps.skip_pending()
        return result

    async def _hold_for_review(self, turn: TurnInput, result: TurnResult) -> TurnResult:
        """The answer waits for a person, who may release it, replace its text, or reject it."""
        return self._with_review(result, await self._review_decision(turn, result.answer))

    async def _review_decision(self, turn: TurnInput, answer: str) -> ReviewDecision:
        """The reviewer's decision on the answer: released as it is, or with their text; rejected fails the turn."""
        reason = "review requested" if turn.question.require_review else "answer without a supporting citation"
        decision = await self.reviews.ask(
            reason=reason, detail=f"answer to {turn.question.message[:200]!r} is held until a reviewer releases it",
            proposed_action={"action": "release_answer", "answer": answer[:2000], **self._numbered_passages()},
            goal=turn.question.message, depth=0, timeout=timedelta(seconds=turn.review_timeout_seconds),
            withheld=("answer",))
        if decision.decision == "reject":
            raise ApplicationError(f"answer rejected by {decision.reviewer}: {decision.comment or 'no comment'}",
                                   type="AnswerRejected", non_retryable=True)
        return decision

    def _with_review(self, result: TurnResult, decision: ReviewDecision) -> TurnResult:
        review = self.reviews.history[-1]
        if decision.answer and decision.answer != result.answer and workflow.patched(REVIEWER_ANSWER_PATCH):
            return self._reviewers_answer(result, decision.answer).model_copy(update={"review": review})
        return result.model_copy(update={"answer": decision.answer or result.answer, "review": review})

    def _numbered_passages(self) -> dict:
        """What a reviewer's [n] would cite: the turn's passages, numbered as the model saw them."""
        if not workflow.patched(REVIEW_PASSAGES_PATCH):
            return {}
        return {"passages": [{"n": n, "filename": c.filename, "page": c.page, "opening": c.quote}
                             for n, c in enumerate(self._passages, 1)]}

    def _reviewers_answer(self, result: TurnResult, text: str) -> TurnResult:
        """A reviewer's text in place of the model's answer. Its citations are the turn's passages its own [n]
        markers name (numbered as the model saw them), each quoting the sentence of the passage's opening it
        draws on; the model's citations, and what the turn told about the model's answer, went with that answer."""
        cited = [self._passages[n - 1] for n in marked_passages(text, len(self._passages))]
        citations = [c.model_copy(update={"quote": quote_for(text, c.quote)}) for c in cited]
        warnings = [w for w in result.warnings if w not in self._model_answer_warnings]
        return result.model_copy(update={"answer": text, "citations": citations, "supported": bool(citations),
                                         "warnings": warnings, "written_by_reviewer": True, "answered": True})


class _GrewMidTurn(Exception):
    """The session's run grew long while its head turn waits: it continues as new, carrying that turn."""


@workflow.defn
class ChatSessionWorkflow:
    @workflow.init
    def __init__(self, state: SessionState) -> None:
        self.state = state
        # Turns accepted and not yet run, in acceptance order. Those carried over from an earlier run
        # have jobs that run started: they get their go by id.
        self.queue: deque[TurnInput] = deque(state.pending)
        self.seen: deque[str] = deque(state.seen, maxlen=MAX_SEEN)
        self.starts: dict[str, asyncio.Future[workflow.ChildWorkflowHandle | None]] = {}
        self.turns_this_run = 0
        self.busy = False  # a turn is running: later turns wait for their go
        # The running turn's final answer, told before its job ends (in an earlier run, for a carried turn).
        self.answered: dict[str, str] = dict(state.answered)
        # Started again after a run ended idle: turns wait here, unnumbered, until what it left is taken up.
        self.taking_up = state.resumed_from is not None
        self.held: list[TurnInput] = []
        self.submits_this_run = 0
        self.refusing: dict[str, asyncio.Future] = {}  # turns refused (session full) whose jobs are starting
        self.stays_mid_turn = False  # replaying a run that did not continue as new while its turn waited
        self.stepping_aside: set[str] = set()  # turns whose side steps wait for the next turn's answer
        self.before: str | None = state.next_tells  # ... the one of them just run: the next turn tells it

    @workflow.signal
    def submit(self, turn: TurnInput) -> None:
        if self.taking_up:
            self.held.append(turn)
            return
        if turn.job_id in self.seen:  # the same request, resent
            if self._started_before(turn.job_id) and workflow.patched(RESENT_AFTER_GONE_PATCH):
                # The API found no job under its id: gone (or, in a race, started a moment ago, where this start
                # fails and changes nothing).
                self._refuse(turn.model_copy(update={"refused": KEY_EXPIRED, "refused_type": KEY_EXPIRED_TYPE}))
            return
        self.seen.append(turn.job_id)
        self.submits_this_run += 1
        if turn.session_max_queued is not None and len(self.queue) >= turn.session_max_queued \
                and workflow.patched(SESSION_REFUSES_PATCH):
            # Not numbered, not queued: its job (the 202 named it) starts only to fail with the reason.
            self._refuse(turn.model_copy(update={"refused": session_busy(len(self.queue))}))
            return
        turn = turn.model_copy(update={"turn": self.state.next_turn})
        if not self.busy and not self.queue:
            # Nothing runs before it: the go travels with the start, one signal round trip less.
            turn.context = TurnContext(history=self.state.history[-HISTORY_TURNS:])
        self.state.next_turn += 1
        self.queue.append(turn)
        self.starts[turn.job_id] = asyncio.ensure_future(self._start(turn))

    def _started_before(self, job_id: str) -> bool:
        """A job id this session has seen and is not starting now, queueing or refusing: its job was started
        (by this run or an earlier one) and has left the queue."""
        return job_id not in self.starts and job_id not in self.refusing \
            and all(t.job_id != job_id for t in self.queue)

    def _refuse(self, turn: TurnInput) -> None:
        started = self.refusing[turn.job_id] = asyncio.ensure_future(self._start_refused(turn))
        started.add_done_callback(lambda _: self.refusing.pop(turn.job_id, None))

    async def _start_refused(self, turn: TurnInput) -> None:
        child = await self._start(turn)
        if child is not None:  # its failure (SessionBusy) is all it does: nobody awaits it
            child.add_done_callback(lambda ended: ended.cancelled() or ended.exception())

    @workflow.signal
    def turn_answered(self, told: TurnAnswered) -> None:
        if self.queue and self.queue[0].job_id == told.job_id:
            self.answered[told.job_id] = told.answer
            if told.steps_aside:
                self.stepping_aside.add(told.job_id)

    @workflow.query
    def pending_turns(self) -> list[TurnInput]:
        return list(self.queue)

    async def _start(self, turn: TurnInput) -> workflow.ChildWorkflowHandle | None:
        """The turn's job, queued until its go; None when a job with this id exists already (the same
        request reached an earlier session with this id: that job answers it)."""
        try:
            # The turn's job joins its own request's trace (the session lives in its first request's).
            with tracing.attached(turn.traceparent):
                return await workflow.start_child_workflow(
                    ChatTurnWorkflow.run, turn, id=turn.job_id,
                    id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                    priority=policies.turn_priority(turn.tenant, turn.fairness_weight),
                    parent_close_policy=workflow.ParentClosePolicy.ABANDON,
                    memo={"turn": turn.turn or None, "message": turn.question.message[:500],
                          **({REQUEST_MEMO: turn.request} if turn.request else {})},
                    search_attributes=TypedSearchAttributes([
                        SearchAttributePair(sa.JOB_KIND, "chat"),
                        SearchAttributePair(sa.JOB_STATUS, "queued"),
                        SearchAttributePair(sa.COLLECTION, turn.question.collection),
                        SearchAttributePair(sa.SESSION, self.state.session_id),
                        SearchAttributePair(sa.TENANT, turn.tenant),
                    ]))
        except WorkflowAlreadyStartedError:
            return None

    @workflow.run
    async def run(self, state: SessionState) -> SessionState | None:
        if state.resumed_from is not None:
            await self._take_up(state.resumed_from)
        while True:
            if not await self._work_before_idle():
                return self._carried()  # what the run that takes the session up again starts from
            if self._should_continue_as_new():
                await self._settle()
                workflow.continue_as_new(self._carried())
            head = self.queue[0]
            self.busy = True
            try:
                answer = await self._run_turn(head)
            except _GrewMidTurn:  # the next run awaits the turn
                await self._settle()
                workflow.continue_as_new(self._carried())
            self.busy = False
            if answer is not None:
                self.state.history.append(HistoryItem(question=head.question.message[:HISTORY_ANSWER_CHARS],
                                                      answer=answer[:HISTORY_ANSWER_CHARS]))
                del self.state.history[:-HISTORY_TURNS]
            self.queue.popleft()
            self.turns_this_run += 1

    async def _run_turn(self, head: TurnInput) -> str | None:
        """Give the turn its go and wait for it; the answer, or None when the turn failed. What the session
        sends for the turn (its go, a follow-up's wait) is traced in the turn's request, not the session's first."""
        with tracing.attached(head.traceparent):
            return await self._run_turn_traced(head)

    async def _run_turn_traced(self, head: TurnInput) -> str | None:
        context = TurnContext(history=self.state.history[-HISTORY_TURNS:], before=self.before)
        self.before = None
        start = self.starts.pop(head.job_id, None)
        child = await start if start is not None else None
        if child is not None:
            if head.context is None:
                try:
                    await child.signal(ChatTurnWorkflow.proceed, context)
                except FailureError:
                    pass  # it has ended already (cancelled while it waited): its outcome is all that is left
            if workflow.patched(NEXT_TURN_AFTER_ANSWER_PATCH):
                return await self._answer_of(head, child)
            return await self._outcome(child)
        # A job this run did not start: carried over through continue-as-new, or already there.
        try:
            await workflow.get_external_workflow_handle(head.job_id).signal(ChatTurnWorkflow.proceed, context)
        except FailureError:
            pass  # it has ended already; its outcome is all that is left to read
        asks = workflow.patched(CARRIED_TURN_ASKED_PATCH)
        ended = asyncio.ensure_future(
            policies.execute(JobActivities.await_turn, AwaitTurnInput(workflow_id=head.job_id)))
        asked = False
        while True:
            await workflow.wait_condition(
                lambda: ended.done() or self._grown_mid_turn()
                or (asks and (head.job_id in self.answered or (not asked and len(self.queue) > 1))))
            if ended.done():
                return self._told_at_the_end(head, ended.result().answer)
            if asks and head.job_id in self.answered:
                ended.cancel()  # its answer is final: the next turn goes, whatever its side steps still do
                self._next_tells(head)
                return self.answered.pop(head.job_id) or None
            if asks and not asked and len(self.queue) > 1:
                asked = True
                try:
                    await workflow.get_external_workflow_handle(head.job_id).signal(
                        ChatTurnWorkflow.follow_up_waits)
                except FailureError:
                    pass  # it has ended: its outcome is coming
                continue
            self._carry_on_mid_turn()

    def _next_tells(self, head: TurnInput) -> None:
        """A turn told its answer: if its side steps step aside for the next answer, the next turn tells it."""
        if head.job_id in self.stepping_aside:
            self.stepping_aside.discard(head.job_id)
            self.before = head.job_id

    def _told_at_the_end(self, head: TurnInput, outcome: str | None) -> str | None:
        """The turn's answer from its end, or, when the end had none to carry (a cancel), what it told."""
        told = self.answered.pop(head.job_id, None)
        if outcome is None and told and workflow.patched(CANCELLED_TURN_ANSWER_PATCH):
            return told
        return outcome

    async def _answer_of(self, head: TurnInput, child: workflow.ChildWorkflowHandle) -> str | None:
        """The turn's answer as soon as it is final, if a later turn waits for it (the job is asked, then tells
        once its answer is shown: a held one once released); else, or if it never tells (a failed turn, an
        older worker), at the job's end."""
        outcome = asyncio.ensure_future(self._outcome(child))
        asked = False
        while True:
            await workflow.wait_condition(
                lambda: outcome.done() or head.job_id in self.answered or (not asked and len(self.queue) > 1)
                or self._grown_mid_turn())
            if outcome.done():
                return self._told_at_the_end(head, outcome.result())
            if head.job_id in self.answered:
                self._next_tells(head)
                return self.answered.pop(head.job_id) or None  # "": no answer, nothing for history
            if self._grown_mid_turn():
                self._carry_on_mid_turn()
                continue
            asked = True
            try:
                await child.signal(ChatTurnWorkflow.follow_up_waits)
            except FailureError:
                pass  # it has ended: its outcome is coming

    @staticmethod
    async def _outcome(child: workflow.ChildWorkflowHandle) -> str | None:
        try:
            result = await child
        except ChildWorkflowError as exc:
            shown = failure_detail(exc.cause, FINAL_ANSWER_DETAIL)
            return shown if shown and workflow.patched(FAILED_TURN_ANSWER_PATCH) else None
        return result.answer if result.answered else None

    def _carried(self) -> SessionState:
        # A waiting turn's job has its question already: the next run keeps what goes into the history. (Whole
        # messages, 8,000 characters each, would take a full session's input past Temporal's 2 MB.)
        pending = [turn.model_copy(update={"question": turn.question.model_copy(
            update={"message": turn.question.message[:HISTORY_ANSWER_CHARS]})}) for turn in self.queue]
        # A turn tells its answer once: told in this run (after it chose to continue as new), it is carried.
        queued = {turn.job_id for turn in self.queue}
        answered = {job_id: told for job_id, told in self.answered.items() if job_id in queued}
        return self.state.model_copy(update={"pending": pending, "seen": list(self.seen), "resumed_from": None,
                                             "answered": answered, "next_tells": self.before})

    async def _take_up(self, run_id: str) -> None:
        """What the session's run that ended idle left (turn numbers, history, the requests it saw), before
        the turns sent meanwhile are numbered. Nothing when that run ended otherwise: the session starts anew."""
        try:
            left: SessionLeft = await policies.execute(
                JobActivities.session_left, SessionRun(workflow_id=workflow.info().workflow_id, run_id=run_id))
        except ActivityError as exc:
            if is_cancelled_exception(exc):
                raise
            # (Its result unreadable, say: a codec key dropped.) The turns sent meanwhile still run.
            workflow.logger.warning("could not read what the session's ended run left; it starts anew: %s", exc)
            left = SessionLeft()
        if left.state is not None:
            self.state = self.state.model_copy(update={"next_turn": left.state.next_turn,
                                                       "history": left.state.history})
            self.seen.extend(left.state.seen)
        self.taking_up = False
        for turn in self.held:
            self.submit(turn)
        self.held.clear()

    async def _work_before_idle(self) -> bool:
        """Waits for a turn to run (or the time to continue as new); False once the session has had none for
        [sessions] idle and has nothing left to do: it ends."""
        def ready() -> bool:
            return bool(self.queue) or self._should_continue_as_new()
        if ready():  # (no wait, no timer: a turn's first workflow task issues nothing more than before)
            return True
        if not workflow.patched(SESSION_ENDS_IDLE_PATCH):
            await workflow.wait_condition(ready)
            return True
        try:
            await workflow.wait_condition(ready, timeout=policies.session_idle())
        except asyncio.TimeoutError:
            await self._settle()
        # A message that came as the wait ended is taken (one that comes as the run completes fails the
        # completion: the server hands it to this run, which goes on).
        return ready()

    def _should_continue_as_new(self) -> bool:
        return self.turns_this_run >= self.state.turns_per_run or workflow.info().is_continue_as_new_suggested()

    def _grown_mid_turn(self) -> bool:
        return not self.stays_mid_turn and (self.submits_this_run >= self.state.submits_per_run
                                            or workflow.info().is_continue_as_new_suggested())

    def _carry_on_mid_turn(self) -> None:
        """Continue as new (raises _GrewMidTurn), unless replaying a run that waited on."""
        if workflow.patched(SESSION_CONTINUES_MID_TURN_PATCH):
            raise _GrewMidTurn
        self.stays_mid_turn = True

    async def _settle(self) -> None:
        """Before continue-as-new: every accepted turn's job has been started and every signal handled."""
        while True:
            await workflow.wait_condition(workflow.all_handlers_finished)
            starting = [f for f in (*self.starts.values(), *self.refusing.values()) if not f.done()]
            if not starting:
                return
            await asyncio.gather(*starting)
