"""Agents: plan with the model, call allowlisted tools, delegate to sub-agents as child workflows.

AgentWorkflow (id agent-<uuid>, children <parent id>.<n>)
  loop: guard the budget -> agent_plan (tool calling) -> for each tool call:
          search_documents -> observation
          delegate(subgoal) -> guards (depth, loop, budget) -> child AgentWorkflow, in parallel
          finish(answer) -> done
  A tripped guard does not start more work: the agent waits for a person's `review`
  (approve: go on, with extensions; reject: stop this branch and finish with what it has;
  revise: go on with new instructions), or rejects itself when the review times out.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.contrib.workflow_streams import WorkflowStream
from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError

with workflow.unsafe.imports_passed_through():
    from activities.agent_models import PlanInput, PlanOutput, SearchDocumentsInput, SearchDocumentsOutput
    from temporal import policies
    from temporal import search_attributes as sa
    from workflows.models import (
        AgentInput, AgentNode, AgentResult, Budget, JobProgress, ReviewDecision, Spend, agent_workflow_id,
    )
    from workflows.review import ReviewHandlers, Reviews
    from workflows.steps import OperatorHandlers, Steps, failure_reason

MAX_TURNS = 8            # planning rounds per agent
MAX_OBSERVATIONS = 8     # observations kept for the next plan (each is short)


def _normalise(goal: str) -> str:
    return " ".join(goal.lower().split()).strip(" .?!")


@workflow.defn
class AgentWorkflow(OperatorHandlers, ReviewHandlers):
    def __init__(self) -> None:
        self.stream = WorkflowStream()
        self.steps = Steps(self.stream, [])
        self.reviews = Reviews(self.steps)
        self.spent = Spend()
        self.children: list[AgentNode] = []
        self.child_decisions: list[dict] = []

    @workflow.query
    def progress(self) -> JobProgress:
        view = self.steps.view()
        view.decisions = [*view.decisions, *self.reviews.history]
        return view

    @workflow.run
    async def run(self, inp: AgentInput) -> AgentResult:
        self.inp = inp
        self.max_depth = inp.max_depth
        self.budget = inp.budget.model_copy()
        self.deadline = inp.deadline or workflow.now() + timedelta(seconds=inp.budget.max_seconds)
        self.steps.context = {"depth": inp.depth}
        self.steps.emit("ragline.job.accepted", {"goal": inp.goal, "depth": inp.depth, "max_depth": inp.max_depth})
        self.steps.set_status("running")
        try:
            answer, status = await self._loop()
        except (ActivityError, ApplicationError) as exc:
            reason = failure_reason(exc)
            await self.steps.finish("ragline.job.failed", {"error": reason})
            raise ApplicationError(reason, non_retryable=True) from exc
        result = AgentResult(
            answer=answer, status=status, llm_calls=self.spent.llm_calls, tokens=self.spent.tokens,
            decisions=[*self.reviews.history, *self.child_decisions],
            tree=AgentNode(goal=inp.goal, depth=inp.depth, job_id=workflow.info().workflow_id, status=status,
                           answer=answer, children=self.children))
        await self.steps.finish("ragline.job.completed", result.model_dump(mode="json"))
        return result

    # -- the loop ---------------------------------------------------------------------------------
    async def _loop(self) -> tuple[str, str]:
        inp = self.inp
        observations: list[str] = []
        instructions = ""
        for turn in range(1, MAX_TURNS + 1):
            over = self._over_budget()
            if over:
                decision = await self._review("budget", over, {"action": "plan", "goal": inp.goal})
                if decision.decision == "reject":
                    return self._partial(observations), "stopped"
                instructions = decision.instructions or instructions
            name = f"plan {turn}"
            plan = await self.steps.run(name, lambda: workflow.execute_activity(
                "agent_plan", PlanInput(goal=inp.goal, instructions=instructions,
                                        observations=observations[-MAX_OBSERVATIONS:], depth=inp.depth,
                                        max_depth=self.max_depth),
                result_type=PlanOutput, **policies.options("agent_plan")))
            self.spent.add(Spend(llm_calls=1, tokens=plan.prompt_tokens + plan.completion_tokens))
            if not plan.calls:
                return plan.text.strip() or self._partial(observations), "finished"
            subgoals = []
            for call in plan.calls:
                if call.error:
                    observations.append(f"tool error: {call.error}")
                elif call.name == "finish":
                    return call.arguments["answer"], "finished"
                elif call.name == "search_documents":
                    found = await self.steps.run(f"search {turn}", lambda: workflow.execute_activity(
                        "search_documents", SearchDocumentsInput(query=call.arguments["query"],
                                                                 collection=inp.collection),
                        result_type=SearchDocumentsOutput, **policies.options("search_documents")))
                    observations.append(found.observation)
                elif call.name == "delegate":
                    subgoals.append(call.arguments["subgoal"])
            if subgoals:
                outcome = await self._delegate(subgoals)
                if outcome is None:
                    return self._partial(observations), "stopped"
                observations.extend(outcome)
        return self._partial(observations), "stopped"

    async def _delegate(self, subgoals: list[str]) -> list[str] | None:
        """Child agents for `subgoals`, in parallel, once every guard passes (or a person approves).
        None when a reviewer rejected: this branch stops."""
        guard = self._delegation_guard(subgoals)
        if guard is not None:
            reason, detail = guard
            decision = await self._review(reason, detail, {"action": "delegate", "subgoals": subgoals})
            if decision.decision == "reject":
                return None
            if decision.decision == "revise":
                return [f"a reviewer said instead of delegating: {decision.instructions or decision.comment}"]
            # approve: this delegation goes ahead, with whatever extension came with it
        share = len(subgoals)
        child_budget = Budget(
            max_llm_calls=max(0, (self.budget.max_llm_calls - self.spent.llm_calls) // share),
            max_tokens=max(0, (self.budget.max_tokens - self.spent.tokens) // share),
            max_seconds=self.budget.max_seconds)
        base = len(self.children)
        results = await asyncio.gather(*(self._child(base + i + 1, goal, child_budget)
                                         for i, goal in enumerate(subgoals)))
        return [f"sub-agent on {goal!r}: {answer}" for goal, answer in zip(subgoals, results)]

    async def _child(self, index: int, goal: str, budget: Budget) -> str:
        inp = self.inp
        child_id = agent_workflow_id(workflow.info().workflow_id, index)
        node = AgentNode(goal=goal, depth=inp.depth + 1, job_id=child_id, status="running")
        self.children.append(node)
        self.steps.start(f"delegate {index}", detail=goal)
        try:
            result: AgentResult = await workflow.execute_child_workflow(
                AgentWorkflow.run,
                AgentInput(goal=goal, collection=inp.collection, depth=inp.depth + 1, max_depth=self.max_depth,
                           budget=budget, deadline=self.deadline, ancestors=[*inp.ancestors, inp.goal],
                           review_timeout_seconds=inp.review_timeout_seconds),
                id=child_id,
                search_attributes=TypedSearchAttributes([
                    SearchAttributePair(sa.JOB_KIND, "agent"), SearchAttributePair(sa.JOB_STATUS, "queued"),
                    SearchAttributePair(sa.COLLECTION, inp.collection)]))
        except ChildWorkflowError as exc:
            node.status, node.answer = "failed", failure_reason(exc)
            self.steps.fail(f"delegate {index}", node.answer)
            return f"(failed: {node.answer})"
        self.spent.add(Spend(llm_calls=result.llm_calls, tokens=result.tokens))
        self.child_decisions.extend(result.decisions)
        node.status, node.answer, node.children = result.status, result.answer, result.tree.children
        self.steps.complete(f"delegate {index}", detail=goal)
        return result.answer

    # -- guards and review ----------------------------------------------------------------------------
    def _delegation_guard(self, subgoals: list[str]) -> tuple[str, str] | None:
        inp = self.inp
        if inp.depth + 1 > self.max_depth:
            return "depth", f"delegating would reach depth {inp.depth + 1}, past max_depth {self.max_depth}"
        seen = {_normalise(g) for g in [*inp.ancestors, inp.goal]}
        for goal in subgoals:
            if _normalise(goal) in seen:
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

    async def _review(self, reason: str, detail: str, proposed: dict) -> ReviewDecision:
        decision = await self.reviews.ask(
            reason=reason, detail=detail, proposed_action=proposed, goal=self.inp.goal, depth=self.inp.depth,
            timeout=timedelta(seconds=self.inp.review_timeout_seconds))
        if decision.decision == "approve":
            self.max_depth += decision.extra_depth
            extra = decision.extra_budget
            self.budget.max_llm_calls += int(extra.get("max_llm_calls", 0))
            self.budget.max_tokens += int(extra.get("max_tokens", 0))
            if extra.get("max_seconds"):
                self.budget.max_seconds += extra["max_seconds"]
                self.deadline += timedelta(seconds=extra["max_seconds"])
        return decision

    @staticmethod
    def _partial(observations: list[str]) -> str:
        if not observations:
            return "Stopped before finding an answer."
        return "Stopped before finishing. What was found: " + " ".join(observations[-3:])
