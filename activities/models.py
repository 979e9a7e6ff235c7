"""Inputs and outputs of activities. Small by design: large data travels as blob references."""

from __future__ import annotations

from pydantic import BaseModel


class StepResult(BaseModel):
    # Which attempt produced this result, so a job's steps can show retries after the fact.
    attempt: int = 1


class ExtractInput(BaseModel):
    document_id: str
    blob_ref: str
    filename: str
    kind: str  # "pdf" | "text"
    password: str | None = None


class ExtractOutput(StepResult):
    pages_ref: str
    pages: int
    chars: int


class ChunkInput(BaseModel):
    document_id: str
    pages_ref: str


class ChunkOutput(StepResult):
    chunks_ref: str
    chunks: int
    # Chosen by the activity from settings and recorded in history, so replays plan the same batches.
    batch_size: int
    parallelism: int


class EmbedInput(BaseModel):
    chunks_ref: str
    start: int
    end: int


class EmbedOutput(StepResult):
    vectors_ref: str
    count: int
    model: str


class IndexInput(BaseModel):
    document_id: str
    collection: str
    filename: str
    chunks_ref: str
    vectors_ref: str
    start: int
    end: int


class IndexOutput(StepResult):
    points: int


class PruneInput(BaseModel):
    document_id: str
    collection: str
    keep_chunks: int


class PruneOutput(StepResult):
    points: int


class AwaitDocumentInput(BaseModel):
    workflow_id: str


class SearchInput(BaseModel):
    query: str
    collection: str
    top_k: int = 5


class SearchHit(BaseModel):
    text: str
    document_id: str
    filename: str
    page: int
    chunk: int
    score: float


class SearchOutput(BaseModel):
    hits: list[SearchHit]


class AwaitTurnInput(BaseModel):
    workflow_id: str


class AwaitTurnOutput(BaseModel):
    # None when the turn failed.
    answer: str | None = None
