"""Agents: goal, budget, the tree of sub-agents, and the planning step's inputs and outputs."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel

from models.jobs import StepResult
from models.review import ReviewRecord
from models.tenancy import DEFAULT_TENANT


class Budget(BaseModel):
    max_llm_calls: int = 50
    max_tokens: int = 200_000
    max_seconds: float = 3600


class Spend(BaseModel):
    llm_calls: int = 0
    tokens: int = 0

    def add(self, other: "Spend") -> None:
        self.llm_calls += other.llm_calls
        self.tokens += other.tokens


class AgentInput(BaseModel):
    tenant: str = DEFAULT_TENANT
    goal: str
    collection: str = "default"
    depth: int = 0
    max_depth: int = 3
    budget: Budget = Budget()
    # Wall-clock end of the whole tree's time budget (set by the root).
    deadline: datetime | None = None
    ancestors: list[str] = []
    # Sub-goals a reviewer rejected anywhere above: never proposed again in this tree.
    rejected: list[str] = []
    review_timeout_seconds: float = 86400


class AgentNode(BaseModel):
    goal: str
    depth: int
    job_id: str
    status: str
    answer: str = ""
    stopped_reason: str | None = None  # why a `stopped` agent did not finish
    children: list["AgentNode"] = []


class Grant(BaseModel):
    """What reviewers added to budgets in a subtree (approve or revise with `extra_budget`)."""
    llm_calls: int = 0
    tokens: int = 0
    seconds: float = 0

    def add(self, other: "Grant") -> None:
        self.llm_calls += other.llm_calls
        self.tokens += other.tokens
        self.seconds += other.seconds


class CancelledChildSpend(BaseModel):
    """What a sub-agent a person cancelled spent, and what reviewers granted below it: told to its parent
    (signal), since a cancelled workflow's end carries no details as a failure's does."""
    job_id: str
    spent: Spend
    granted: Grant
    decisions: list[ReviewRecord] = []  # made in its subtree: still the tree's record of who decided what


class AgentResult(BaseModel):
    answer: str
    status: Literal["finished", "stopped"]
    # Why a `stopped` agent finished with what it had: a reviewer's rejection (who, of what), a stop it was
    # told, or its planning rounds running out.
    stopped_reason: str | None = None
    tree: AgentNode
    llm_calls: int
    tokens: int
    # Added by reviewers in this subtree: the parent's budget grows by it too, since it pays for what the
    # subtree spent (else an approved extension below trips every ancestor's budget guard in turn).
    granted: Grant = Grant()
    decisions: list[ReviewRecord] = []
    # Sub-goals rejected by a reviewer in this subtree (the parent stops proposing them too).
    rejected: list[str] = []


def agent_workflow_id(parent_id: str, index: int) -> str:
    return f"{parent_id}.{index}"


# -- the planning step ---------------------------------------------------------------------------------

# The agent's tools, as named in its allowlist (`[[agent.tools]]` in ragline/prompts.toml).
TOOL_SEARCH = "search_documents"
TOOL_DELEGATE = "delegate"
TOOL_FINISH = "finish"

class ToolCall(BaseModel):
    name: str
    arguments: dict[str, Any] = {}
    # Set when the model asked for something outside the allowlist or with bad arguments: the agent
    # sees it as a tool error and carries on.
    error: str | None = None


class PlanCorrection(BaseModel):
    """A reply that tried to be a tool call and was malformed, and what was wrong with it: the next plan
    shows both to the model, once."""
    reply: str
    problem: str


class PlanInput(BaseModel):
    goal: str
    instructions: str = ""
    observations: list[str] = []
    depth: int
    max_depth: int
    correction: PlanCorrection | None = None


class PlanOutput(StepResult):
    calls: list[ToolCall]
    text: str = ""
    # Set when `text` tried to be a tool call but was malformed or named no known tool: what was wrong.
    # Such a text is no final answer.
    malformed: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class SearchDocumentsInput(BaseModel):
    tenant: str = DEFAULT_TENANT
    query: str
    collection: str
    top_k: int = 3


class SearchDocumentsOutput(StepResult):
    observation: str
