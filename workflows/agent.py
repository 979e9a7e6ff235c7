"""Agents: plan with the model, call allowlisted tools, delegate to sub-agents as child workflows.

AgentWorkflow (id agent-<uuid>, children <parent id>.<n>)
  loop: guard the budget -> agent_plan (tool calling) -> a malformed call written as text: plan once more,
        told what was wrong (agent_plan fails the job if that reply is malformed too) -> for each tool call:
          search_documents -> observation (a query searched before is not run again: the agent is told so)
          delegate(subgoal) -> guards (depth, loop, budget) -> child AgentWorkflow, in parallel
          finish(answer) -> done
  A tripped guard does not start more work: the agent waits for a person's `review`
  (approve: go on, with extensions; reject: stop and finish with what it has; revise: go on with new
  instructions, and extensions), or rejects itself when the review times out. A rejection sticks for the whole tree:
  the rejected sub-goal is never delegated again, and every ancestor finishes with what it has.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import ChildWorkflowError, is_cancelled_exception

with workflow.unsafe.imports_passed_through():
    from activities.agent import AgentActivities
    from models.agent import (
        TOOL_DELEGATE, TOOL_FINISH, TOOL_SEARCH, AgentInput, AgentNode, AgentResult, Budget, CancelledChildSpend,
        Grant, PlanCorrection, PlanInput, SearchDocumentsInput, Spend, agent_workflow_id,
    )
    from models.review import ReviewDecision, ReviewRecord
    from temporal import search_attributes as sa
    from temporal.errors import failure_detail
    from workflows.children import started_child
    from workflows.dead_letters import ParkWithdrawn
    from workflows.failures import failure_reason
    from workflows.job import ENDED, JobWorkflow
    from workflows.review import ReviewHandlers, ReviewWithdrawn

MAX_TURNS = 8            # planning rounds per agent
MAX_OBSERVATIONS = 8     # observations kept for the next plan (each is short)
# A reply that tries to be a tool call and is malformed gets a corrective re-plan; under earlier code (a
# plan step of a newer worker, a workflow task of an older one) it was taken for the final answer.
REPLAN_MALFORMED_PATCH = "agent-replans-malformed-tool-call"
# A sub-agent that fails says what it spent (its failure's details); earlier parents did not count it.
FAILED_CHILD_SPEND_PATCH = "agent-counts-failed-child-spend"
SPENT_DETAIL = "spent"
# A search the agent already ran is not run again: the agent is told to search for something else or to
# finish, and each plan and search step's detail names the calls and the query. Earlier agents searched the
# same words round after round (a small model pastes the passage it got back in as its next query) until
# their budget ran out.
SEARCH_PROGRESS_PATCH = "agent-search-makes-progress"
# A `revise` brings its extensions (extra_depth, extra_budget) as an `approve` does; earlier ones dropped them.
REVISE_EXTENDS_PATCH = "agent-revise-extends"
# What reviewers granted below an agent extends its budget too: the subtree's spend it pays for included
# the extension. Earlier parents asked for a review of their own budget once such a child returned.
CHILD_GRANTS_PATCH = "agent-child-grants-extend-ancestors"
GRANTED_DETAIL = "granted"
# ... and the review decisions made in it (its own and its subtree's): a failed or cancelled sub-agent's are
# still the tree's record of who decided what (earlier trees kept only a finished child's).
DECISIONS_DETAIL = "decisions"
# ... and its own subtree, as far as it got: the tree's view showed a failed sub-agent with no children, though
# the sub-agents it had started ran (and spent).
TREE_DETAIL = "tree"
# A rejection anywhere in a tree stops the sub-agents running beside it: each is told (signal `stop`) and
# finishes with what it has, a review it waits for withdrawn, and tells its own children. Earlier trees let
# them run on (and ask people for decisions) until the last one ended.
STOP_SIGNAL = "stop"
SIBLINGS_STOP_PATCH = "agent-rejection-stops-running-siblings"
# A sub-agent a person cancelled is not delegated again (its goal counts as refused). Earlier parents took
# it for a failure, and could propose the same sub-goal in their next plan.
CANCELLED_CHILD_PATCH = "agent-cancelled-child-not-delegated-again"
# A sub-goal a sub-agent of this agent already answered is not delegated again (the model is told so): a
# small model proposed the same one round after round, each a sub-agent of its own, until the budget ran out.
DELEGATED_ONCE_PATCH = "agent-sub-goal-delegated-once"
# A sub-agent a person cancels tells its parent what it spent (signal `cancelled_child_spend`), and the parent
# counts it against the tree's budget. Earlier parents counted nothing: the tree went past its budget with
# no review asked. (A sub-agent terminated, or past its run timeout, still cannot tell.)
CANCELLED_CHILD_SPEND_PATCH = "agent-counts-cancelled-child-spend"
CANCELLED_CHILD_SPEND_SIGNAL = "cancelled_child_spend"
# A plan that succeeded on its n-th attempt (counting those before an operator's retry) counts n model calls:
# an attempt that timed out or lost its worker may have had its reply written (and paid for). Earlier agents
# counted one call per plan.
PLAN_ATTEMPTS_PATCH = "agent-counts-every-plan-attempt"
# A plan that never answered (discarded by an operator, past its dead-letter TTL, withdrawn, cancelled) still
# counts its attempts: each may have been paid for. Earlier agents counted none, and a parent could delegate
# the same sub-goal again on a budget that left them out.
UNANSWERED_PLAN_ATTEMPTS_PATCH = "agent-counts-attempts-of-an-unanswered-plan"
# The same sub-goal twice in one plan (as `normalise_goal` reads them) runs one sub-agent. Earlier agents ran
# one for each, on half the budget each.
ONE_CHILD_PER_SUBGOAL_PATCH = "agent-one-sub-agent-per-sub-goal-of-a-plan"
# Seconds a reviewer grants are seconds of work from the decision: a deadline that passed while the review
# waited moves to the decision first. Earlier agents added them to the passed deadline, so the wait for the
# person ate them, and the agent (or the sub-agent it delegated to) asked again after one more plan.
SECONDS_FROM_DECISION_PATCH = "agent-granted-seconds-count-from-the-decision"
# The time a review waits for its person is not the agent's: a decision to go on moves the deadline on by
# it. Earlier agents were charged for it, so one approved (a depth, a loop) after its time had run out in
# the wait asked again at once, "time budget used up", and the reviewer had to decide twice.
REVIEW_WAIT_NOT_CHARGED_PATCH = "agent-review-wait-not-charged"
# Time queued for the tenant's running slot is not the agent's either: its deadline moves on by it. Earlier
# agents were charged for it, so one that waited in line longer than its time budget (a capped tenant's
# busy hour) came out of the line and asked a reviewer for time before doing any work.
SLOT_WAIT_NOT_CHARGED_PATCH = "agent-slot-wait-not-charged"
# A cancel that reaches an agent while it starts a sub-agent cancels that sub-agent once started
# (workflows/children.py), and counts what it spent. Before, the sub-agent ran its plan and was terminated with
# its parent, and that call counted nowhere in the tree's budget.
CHILD_CANCEL_AFTER_START_PATCH = "agent-cancel-waits-for-its-sub-agents-start"


def spent_before_failing(exc: ChildWorkflowError) -> Spend:
    """What a failed sub-agent spent, from its failure (nothing, from a child of older code)."""
    spent = failure_detail(exc.cause, SPENT_DETAIL)
    return Spend.model_validate(spent) if isinstance(spent, dict) else Spend()


def granted_before_failing(exc: ChildWorkflowError) -> Grant:
    """What reviewers granted a failed sub-agent's subtree, from its failure."""
    granted = failure_detail(exc.cause, GRANTED_DETAIL)
    return Grant.model_validate(granted) if isinstance(granted, dict) else Grant()


def decided_before_failing(exc: ChildWorkflowError) -> list[ReviewRecord]:
    """The review decisions made in a failed sub-agent's subtree, from its failure (none from older code)."""
    decided = failure_detail(exc.cause, DECISIONS_DETAIL)
    return [ReviewRecord.model_validate(d) for d in decided] if isinstance(decided, list) else []


def subtree_before_failing(exc: ChildWorkflowError) -> list[AgentNode]:
    """A failed sub-agent's own sub-agents as its tree showed them when it failed (none from older code)."""
    tree = failure_detail(exc.cause, TREE_DETAIL)
    return [AgentNode.model_validate(n) for n in tree] if isinstance(tree, list) else []


def normalise_goal(goal: str) -> str:
    return " ".join(goal.lower().split()).strip(" .?!")


def described(name: str, arguments: dict) -> str:
    """A tool call as a person reads it in the plan step's detail: search_documents(query='…')."""
    shown = ", ".join(f"{k}={str(v)[:120]!r}" for k, v in arguments.items())
    return f"{name}({shown})"


class Stop(Exception):
    """This agent stops and finishes with what it has: a reviewer rejected its action, or one below. Its
    message is why (the result's `stopped_reason`)."""


TOLD_TO_STOP = "told to stop (signal `stop`: a reviewer rejected something elsewhere in its tree, or a person asked)"


@workflow.defn
class AgentWorkflow(JobWorkflow, ReviewHandlers):
    def __init__(self) -> None:
        super().__init__()
        self.spent = Spend()
        self.granted = Grant()  # seconds: set at the end, from how far the deadline moved
        self.children: list[AgentNode] = []
        self.child_decisions: list[ReviewRecord] = []
        self.observations: list[str] = []
        # Sub-goals a reviewer rejected, in this agent, below it, or above it (from its input).
        self.rejected: list[str] = []
        self._searched: set[str] = set()  # queries searched, normalised
        # What the search guard told the model: an observation for its next plan, not something it found.
        self._told: set[str] = set()
        self._stop_asked = False
        # Sub-goals whose sub-agent a person cancelled: not delegated again, though nobody rejected them (the
        # tree does not stop for them, and they are not reported up as rejected).
        self._cancelled_goals: list[str] = []
        self._started: dict[str, workflow.ChildWorkflowHandle] = {}  # sub-agents started, by job id
        self._searches_in_turn: dict[int, int] = {}
        self._cancelled_spend: dict[str, CancelledChildSpend] = {}  # told by sub-agents a person cancelled

    @workflow.run
    async def run(self, inp: AgentInput) -> AgentResult:
        self.inp = inp
        self.max_depth = inp.max_depth
        self.budget = inp.budget.model_copy()
        self.deadline = inp.deadline or workflow.now() + timedelta(seconds=inp.budget.max_seconds)
        self._first_deadline = self.deadline
        self.rejected = list(inp.rejected)
        self.events.context = {"depth": inp.depth}
        return await self.run_job(self._agent, accepted={
            "goal": inp.goal, "depth": inp.depth, "max_depth": inp.max_depth})

    @workflow.signal(name=STOP_SIGNAL)
    def stop_signal(self) -> None:
        """Finish with what it has (a reviewer rejected something elsewhere in its tree; or a person asks)."""
        self._stop_asked = True

    @workflow.signal(name=CANCELLED_CHILD_SPEND_SIGNAL)
    def cancelled_child_spend(self, told: CancelledChildSpend) -> None:
        self._cancelled_spend[told.job_id] = told

    def stopping(self) -> bool:
        return self._stop_asked

    def failure_details(self) -> dict[str, Any]:
        return {SPENT_DETAIL: self.spent.model_dump(), GRANTED_DETAIL: self._granted().model_dump(),
                DECISIONS_DETAIL: [d.model_dump(mode="json") for d in self._decisions()],
                TREE_DETAIL: [n.model_dump(mode="json") for n in self.children]}

    def _decisions(self) -> list[ReviewRecord]:
        return [*self.reviews.history, *self.child_decisions]

    async def _cancelled(self) -> None:
        parent = workflow.info().parent
        if parent is not None and workflow.patched(CANCELLED_CHILD_SPEND_PATCH):
            told = CancelledChildSpend(job_id=workflow.info().workflow_id, spent=self.spent, granted=self._granted(),
                                       decisions=self._decisions())
            try:  # awaited: the parent has the signal before it learns that this sub-agent was cancelled
                await workflow.get_external_workflow_handle(parent.workflow_id).signal(
                    CANCELLED_CHILD_SPEND_SIGNAL, told)
            except Exception as exc:  # noqa: BLE001 - the parent has ended: nobody to tell
                workflow.logger.info("could not tell the parent agent %s what it spent: %s", parent.workflow_id, exc)
        await super()._cancelled()

    def slot_waited(self, waited: timedelta) -> None:
        # Not a grant either: the deadline it started with moves on too.
        if workflow.patched(SLOT_WAIT_NOT_CHARGED_PATCH):
            self.deadline += waited
            self._first_deadline += waited

    def _granted(self) -> Grant:
        moved = (self.deadline - self._first_deadline).total_seconds()
        return self.granted.model_copy(update={"seconds": max(0.0, moved)})

    async def _agent(self) -> AgentResult:
        self.begin()
        why = None
        try:
            answer, status = await self._loop(), "finished"
        except (Stop, ParkWithdrawn) as stopped:  # a step parked for an operator when the stop came is withdrawn
            answer, status = self._partial(), "stopped"
            why = str(stopped) if isinstance(stopped, Stop) else TOLD_TO_STOP
        if answer is None:
            answer, status = self._partial(), "stopped"
            why = f"its {MAX_TURNS} planning rounds ran out before it finished"
        inherited = set(self.inp.rejected)
        return AgentResult(
            answer=answer, status=status, llm_calls=self.spent.llm_calls, tokens=self.spent.tokens,
            granted=self._granted(),
            decisions=self._decisions(),
            rejected=[g for g in self.rejected if g not in inherited],
            stopped_reason=why,
            tree=AgentNode(goal=self.inp.goal, depth=self.inp.depth, job_id=workflow.info().workflow_id,
                           status=status, answer=answer, stopped_reason=why, children=self.children))

    # -- the loop ---------------------------------------------------------------------------------
    async def _loop(self) -> str | None:
        """The final answer, or None when the planning rounds ran out."""
        inp = self.inp
        instructions = ""
        correction: PlanCorrection | None = None
        turn = 0
        # A correction due after the last round still gets its round: a malformed call is never the end.
        while turn < MAX_TURNS or correction is not None:
            if self._stop_asked:
                raise Stop(TOLD_TO_STOP)
            turn += 1
            over = self._over_budget()
            if over:
                decision = await self._review("budget", over, {"action": "plan", "goal": inp.goal})
                if decision.decision == "reject":
                    self.rejected.append(inp.goal)
                    raise Stop(f"{decision.reviewer} rejected more budget ({over})")
                instructions = decision.instructions or instructions
            try:
                plan = await self.step(AgentActivities.agent_plan, PlanInput(
                    goal=inp.goal, instructions=instructions, observations=self.observations[-MAX_OBSERVATIONS:],
                    depth=inp.depth, max_depth=self.max_depth, correction=correction), name=f"plan {turn}")
            except ENDED:
                # What the plan's attempts cost counts, in the spend the parent hears of too.
                if self.steps.attempts(f"plan {turn}") and workflow.patched(UNANSWERED_PLAN_ATTEMPTS_PATCH):
                    self.spent.add(Spend(llm_calls=self.steps.attempts(f"plan {turn}")))
                raise
            # Every attempt of the plan, those before an operator's retry of it included.
            calls = max(1, self.steps.attempts(f"plan {turn}")) if workflow.patched(PLAN_ATTEMPTS_PATCH) else 1
            self.spent.add(Spend(llm_calls=calls, tokens=plan.prompt_tokens + plan.completion_tokens))
            correction = None
            problems = ([f"malformed tool call: {plan.malformed}"] if plan.malformed else []) + [
                f"tool error: {call.error}" for call in plan.calls if call.error]
            if problems:  # else the step's view says only "completed", and the reason is in the history alone
                self.steps.note(f"plan {turn}", "; ".join(problems))
            elif plan.calls and workflow.patched(SEARCH_PROGRESS_PATCH):
                self.steps.note(f"plan {turn}", "; ".join(described(c.name, c.arguments) for c in plan.calls))
            if plan.malformed and workflow.patched(REPLAN_MALFORMED_PATCH):
                correction = PlanCorrection(reply=plan.text, problem=plan.malformed)
                continue
            if not plan.calls:
                return plan.text.strip() or self._partial()
            subgoals = []
            for call in plan.calls:
                if call.error:
                    self.observations.append(f"tool error: {call.error}")
                elif call.name == TOOL_FINISH:
                    return call.arguments["answer"]
                elif call.name == TOOL_SEARCH:
                    await self._search(call.arguments["query"], turn)
                elif call.name == TOOL_DELEGATE:
                    subgoals.append(call.arguments["subgoal"])
            if subgoals:
                await self._delegate(subgoals)
        return None

    async def _search(self, query: str, turn: int) -> None:
        """search_documents, unless the agent searched the same words before: then it is told so, and no
        search runs (it found what it will find)."""
        inp = self.inp
        progress = workflow.patched(SEARCH_PROGRESS_PATCH)
        if progress and normalise_goal(query) in self._searched:
            self._tell(f"search_documents({query!r}) was searched before and found what is above: search for "
                       "something else, or call finish with what the observations show")
            return
        self._searched.add(normalise_goal(query))
        # A plan may search more than once: each search is a step of its own in the job's view.
        self._searches_in_turn[turn] = n = self._searches_in_turn.get(turn, 0) + 1
        name = f"search {turn}" if n == 1 else f"search {turn}.{n}"
        found = await self.step(AgentActivities.search_documents, SearchDocumentsInput(
            tenant=inp.tenant, query=query, collection=inp.collection), name=name)
        if progress:
            self.steps.note(name, f"query: {query!r}")
            if found.observation in self.observations:
                self._tell(f"search_documents({query!r}) found the same passages as an earlier search: search for "
                           "something else, or call finish")
                return
        self.observations.append(found.observation)

    def _tell(self, hint: str) -> None:
        self._told.add(hint)
        self.observations.append(hint)

    def _tell_once(self, hint: str) -> None:
        """A hint the model has not been given among its recent observations (said again, it only crowds
        out what was found; kept out of a stopped agent's answer, like every hint)."""
        if hint not in self.observations[-MAX_OBSERVATIONS:]:
            self._tell(hint)

    async def _delegate(self, subgoals: list[str]) -> None:
        """Child agents for `subgoals`, in parallel, once every guard passes (or a person approves)."""
        rejected = {normalise_goal(g) for g in self.rejected}
        cancelled = {normalise_goal(g) for g in self._cancelled_goals}
        answered = {normalise_goal(n.goal) for n in self.children if n.status in ("finished", "stopped")}
        if not answered & {normalise_goal(g) for g in subgoals} or not workflow.patched(DELEGATED_ONCE_PATCH):
            answered = set()
        for goal in subgoals:
            if normalise_goal(goal) in rejected:
                self._tell_once(f"a reviewer rejected delegating {goal!r}; do not propose it again")
            elif normalise_goal(goal) in cancelled:
                self._tell_once(f"a person cancelled the sub-agent on {goal!r}; do not propose it again")
            elif normalise_goal(goal) in answered:
                self._tell_once(f"a sub-agent already answered {goal!r} (its answer is above): do not delegate "
                                "it again; delegate something else, or call finish")
        subgoals = [g for g in subgoals if normalise_goal(g) not in rejected | cancelled | answered]
        if len({normalise_goal(g) for g in subgoals}) < len(subgoals) and workflow.patched(ONE_CHILD_PER_SUBGOAL_PATCH):
            firsts: dict[str, str] = {}
            for goal in subgoals:
                firsts.setdefault(normalise_goal(goal), goal)
            subgoals = list(firsts.values())
        if not subgoals:
            return
        if self._stop_asked:
            raise Stop(TOLD_TO_STOP)
        guard = self._delegation_guard(subgoals)
        if guard is not None:
            reason, detail = guard
            decision = await self._review(reason, detail, {"action": "delegate", "subgoals": subgoals})
            if decision.decision == "reject":
                self.rejected.extend(subgoals)
                raise Stop(f"{decision.reviewer} rejected its delegation ({reason})")
            if decision.decision == "revise":  # told to the model, and no finding of the agent's
                self._tell(f"a reviewer said instead of delegating: {decision.instructions or decision.comment}")
                return
            # approve: this delegation goes ahead, with whatever extension came with it
        share = len(subgoals)
        child_budget = Budget(
            max_llm_calls=max(0, (self.budget.max_llm_calls - self.spent.llm_calls) // share),
            max_tokens=max(0, (self.budget.max_tokens - self.spent.tokens) // share),
            max_seconds=self.budget.max_seconds)
        base = len(self.children)
        await self.slot.take_back()  # lent while a reviewer decided on this delegation: the children run within it
        if self._stop_asked:  # told meanwhile
            raise Stop(TOLD_TO_STOP)
        children = [asyncio.ensure_future(self._child(base + i + 1, goal, child_budget))
                    for i, goal in enumerate(subgoals)]
        ids = [agent_workflow_id(workflow.info().workflow_id, base + i + 1) for i in range(len(subgoals))]
        watch = asyncio.ensure_future(self._stop_children_when_rejected(children, ids)) \
            if workflow.patched(SIBLINGS_STOP_PATCH) else None
        try:
            results = await asyncio.gather(*children)
        finally:
            if watch is not None:
                watch.cancel()
        self.observations.extend(f"sub-agent on {goal!r}: {answer}" for goal, (answer, _) in zip(subgoals, results))
        if any(rejected_below for _, rejected_below in results):
            # the tree finishes with what it has
            raise Stop("a reviewer rejected something one of its sub-agents asked")

    async def _child(self, index: int, goal: str, budget: Budget) -> tuple[str, bool]:
        """The child's answer, and whether a reviewer rejected anything in its subtree."""
        inp = self.inp
        child_id = agent_workflow_id(workflow.info().workflow_id, index)
        node = AgentNode(goal=goal, depth=inp.depth + 1, job_id=child_id, status="running")
        self.children.append(node)
        step = f"delegate {index}"
        deadline_given = self.deadline
        self.steps.start(step, detail=goal)
        try:
            async with self.waits.child(child_id, step):  # waiting for a reviewer, it lends the tree's slot
                handle = await started_child(workflow.start_child_workflow(
                    AgentWorkflow.run,
                    AgentInput(tenant=inp.tenant, goal=goal, collection=inp.collection, depth=inp.depth + 1,
                               max_depth=self.max_depth, budget=budget, deadline=deadline_given,
                               ancestors=[*inp.ancestors, inp.goal], rejected=[*self.rejected, *self._cancelled_goals],
                               review_timeout_seconds=inp.review_timeout_seconds),
                    id=child_id,
                    search_attributes=TypedSearchAttributes([
                        SearchAttributePair(sa.JOB_KIND, "agent"), SearchAttributePair(sa.JOB_STATUS, "queued"),
                        SearchAttributePair(sa.COLLECTION, inp.collection),
                        SearchAttributePair(sa.TENANT, inp.tenant)])), CHILD_CANCEL_AFTER_START_PATCH)
                self._started[child_id] = handle
                result = await handle
        except ChildWorkflowError as exc:
            if workflow.patched(FAILED_CHILD_SPEND_PATCH):  # what it spent before failing was paid for
                self.spent.add(spent_before_failing(exc))
            self._take_on(granted_before_failing(exc), deadline_given)
            self.child_decisions.extend(decided_before_failing(exc))
            if is_cancelled_exception(exc):
                told = self._cancelled_spend.get(child_id)
                if told is not None and workflow.patched(CANCELLED_CHILD_SPEND_PATCH):
                    self.spent.add(told.spent)
                    self._take_on(told.granted, deadline_given)
                    self.child_decisions.extend(told.decisions)
                node.status, node.answer = "cancelled", "cancelled by a person"
                self.steps.cancel(step)
                if workflow.patched(CANCELLED_CHILD_PATCH):
                    self._cancelled_goals.append(goal)
                return "(cancelled by a person: do not propose it again)", False
            node.status, node.answer = "failed", failure_reason(exc)
            node.children = subtree_before_failing(exc)
            self.steps.fail(step, node.answer)
            return f"(failed: {node.answer})", False
        self.spent.add(Spend(llm_calls=result.llm_calls, tokens=result.tokens))
        self._take_on(result.granted, deadline_given)
        self.child_decisions.extend(result.decisions)
        self.rejected.extend(g for g in result.rejected if g not in self.rejected)
        node.status, node.answer, node.children = result.status, result.answer, result.tree.children
        node.stopped_reason = result.stopped_reason
        self.steps.complete(step, detail=goal)
        return result.answer, bool(result.rejected)

    async def _stop_children_when_rejected(self, children: list[asyncio.Future[tuple[str, bool]]],
                                           ids: list[str]) -> None:
        """Once a child comes back with a rejection below it, or this agent is told to stop, the children
        still running are told to stop too: they finish with what they have (and what they spent counts)."""
        def rejected_below() -> bool:
            return any(c.done() and not c.cancelled() and c.exception() is None and c.result()[1] for c in children)

        def to_tell() -> list[str]:  # running, started (a signal to a child not yet started would be lost)
            return [i for c, i in zip(children, ids) if not c.done() and i in self._started and i not in told]

        told: set[str] = set()
        await workflow.wait_condition(lambda: self._stop_asked or rejected_below() or all(c.done() for c in children))
        while not all(c.done() or i in told for c, i in zip(children, ids)):
            await workflow.wait_condition(lambda: bool(to_tell()) or all(c.done() or i in told
                                                                         for c, i in zip(children, ids)))
            for child_id in to_tell():
                told.add(child_id)
                try:
                    await self._started[child_id].signal(STOP_SIGNAL)
                except Exception as exc:  # noqa: BLE001 - it ended meanwhile: nothing to stop
                    workflow.logger.info("could not tell sub-agent %s to stop: %s", child_id, exc)

    # -- guards and review ----------------------------------------------------------------------------
    def _delegation_guard(self, subgoals: list[str]) -> tuple[str, str] | None:
        inp = self.inp
        if inp.depth + 1 > self.max_depth:
            return "depth", f"delegating would reach depth {inp.depth + 1}, past max_depth {self.max_depth}"
        seen = {normalise_goal(g) for g in [*inp.ancestors, inp.goal]}
        for goal in subgoals:
            if normalise_goal(goal) in seen:
                return "loop", f"sub-goal {goal!r} repeats a goal of this agent or one of its ancestors"
        over = self._over_budget()
        if over:
            return "budget", over
        if self.budget.max_llm_calls - self.spent.llm_calls < len(subgoals):
            return "budget", (f"{self.budget.max_llm_calls - self.spent.llm_calls} model calls left, not enough "
                              f"for {len(subgoals)} sub-agents")
        return None

    def _over_budget(self) -> str | None:
        if self.spent.llm_calls >= self.budget.max_llm_calls:
            return f"model-call budget used up ({self.spent.llm_calls} of {self.budget.max_llm_calls})"
        if self.spent.tokens >= self.budget.max_tokens:
            return f"token budget used up ({self.spent.tokens} of {self.budget.max_tokens})"
        if workflow.now() >= self.deadline:
            return f"time budget used up ({self.budget.max_seconds:g} s)"
        return None

    def _take_on(self, granted: Grant, deadline_given: datetime) -> None:
        """Reviewers granted a child's subtree more than it was given: this agent's budget grows by as much."""
        if not (granted.llm_calls or granted.tokens or granted.seconds) or not workflow.patched(CHILD_GRANTS_PATCH):
            return
        self.budget.max_llm_calls += granted.llm_calls
        self.budget.max_tokens += granted.tokens
        self.granted.add(Grant(llm_calls=granted.llm_calls, tokens=granted.tokens))
        # Children share the deadline they were given: the latest one a reviewer moved it to holds here too.
        self.deadline = max(self.deadline, deadline_given + timedelta(seconds=granted.seconds))

    async def _review(self, reason: str, detail: str, proposed: dict) -> ReviewDecision:
        asked_at = workflow.now()
        try:
            decision = await self.reviews.ask(
                reason=reason, detail=detail, proposed_action=proposed, goal=self.inp.goal, depth=self.inp.depth,
                timeout=timedelta(seconds=self.inp.review_timeout_seconds), withdraw_when=lambda: self._stop_asked)
        except ReviewWithdrawn:
            raise Stop(TOLD_TO_STOP) from None
        if self._stop_asked and decision.decision != "reject":  # told to stop while the reviewer decided
            raise Stop(TOLD_TO_STOP)
        if decision.decision == "approve" or (decision.decision == "revise" and workflow.patched(REVISE_EXTENDS_PATCH)):
            self.max_depth += decision.extra_depth
            extra = decision.extra_budget
            grant = Grant(llm_calls=int(extra.get("max_llm_calls", 0)), tokens=int(extra.get("max_tokens", 0)))
            self.budget.max_llm_calls += grant.llm_calls
            self.budget.max_tokens += grant.tokens
            self.granted.add(grant)
            if workflow.patched(REVIEW_WAIT_NOT_CHARGED_PATCH):
                self.deadline += workflow.now() - asked_at
            if extra.get("max_seconds"):
                self.budget.max_seconds += extra["max_seconds"]
                if workflow.patched(SECONDS_FROM_DECISION_PATCH):
                    self.deadline = max(self.deadline, workflow.now())
                self.deadline += timedelta(seconds=extra["max_seconds"])
        return decision

    def _partial(self) -> str:
        # What its searches and sub-agents found, each once and apart (run together, one passage read into the next).
        found = list(dict.fromkeys(o for o in self.observations if o not in self._told))
        if not found:
            return "Stopped before finding an answer."
        return "Stopped before finishing. What was found:\n\n" + "\n\n".join(found[-3:])
