"""Inputs and outputs of the chat-chain activities."""

from __future__ import annotations

from pydantic import BaseModel

from activities.models import StepResult


class Citation(BaseModel):
    document_id: str
    filename: str
    page: int
    chunk_id: str
    score: float


class Entity(BaseModel):
    text: str
    type: str


class HistoryItem(BaseModel):
    question: str
    answer: str


class RetrieveInput(BaseModel):
    question: str
    collection: str
    top_k: int


class RetrieveOutput(StepResult):
    # Passages (with their text) live in the blob store; only the reference travels.
    context_ref: str
    passages: int
    citations: list[Citation]


class ContextInput(BaseModel):
    question: str
    context_ref: str


class SummaryOutput(StepResult):
    summary: str
    prompt_tokens: int = 0
    completion_tokens: int = 0


class EntitiesOutput(StepResult):
    entities: list[Entity]
    warnings: list[str] = []
    prompt_tokens: int = 0
    completion_tokens: int = 0


class GenerateInput(BaseModel):
    question: str
    context_ref: str
    summary: str
    entities: list[Entity]
    history: list[HistoryItem]


class GenerateOutput(StepResult):
    answer: str
    # 1-based numbers of the passages the answer relies on.
    cited: list[int]
    model: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
