"""Inputs and outputs of the agent's activities."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from activities.models import StepResult


class ToolCall(BaseModel):
    name: str
    arguments: dict[str, Any] = {}
    # Set when the model asked for something outside the allowlist or with bad arguments: the agent
    # sees it as a tool error and carries on.
    error: str | None = None


class PlanInput(BaseModel):
    goal: str
    instructions: str = ""
    observations: list[str] = []
    depth: int
    max_depth: int


class PlanOutput(StepResult):
    calls: list[ToolCall]
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0


class SearchDocumentsInput(BaseModel):
    query: str
    collection: str
    top_k: int = 3


class SearchDocumentsOutput(StepResult):
    observation: str
