"""Retrieval and answer quality of a collection against golden questions: the arithmetic shared by the
evaluation workflow (`POST /v1/evaluations`) and `make bench`.

A golden question is one JSONL line: `{"question", "expected_document", "expected_answer"?}`.
`expected_document` is a filename or a document id of the collection; null (or "") marks a question
the documents do not answer (out of corpus): the right outcome is an honest "the documents do not
cover it" (`supported: false`), not an answer.
"""

from __future__ import annotations

import json
import re
import unicodedata

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_QUESTIONS = 2000


class GoldenQuestion(BaseModel):
    # A misspelt field would otherwise read as a question the documents do not answer, and skew the report.
    model_config = ConfigDict(extra="forbid")
    question: str = Field(min_length=1, max_length=8000)
    expected_document: str | None  # required: null for a question the documents do not answer
    expected_answer: str | None = None

    @field_validator("expected_document", "expected_answer")
    @classmethod
    def _blank_is_none(cls, v: str | None) -> str | None:
        return v.strip() or None if isinstance(v, str) else v

    @property
    def in_corpus(self) -> bool:
        return self.expected_document is not None


def parse_jsonl(data: str) -> list[GoldenQuestion]:
    """Golden questions from JSONL; ValueError naming the first bad line."""
    questions = []
    for n, line in enumerate(data.removeprefix("\ufeff").splitlines(), 1):  # a BOM an editor saved
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            if exc.msg == "Extra data" and line[exc.pos:].lstrip().startswith("{"):
                # `curl -d @golden.jsonl` sends the file with its line breaks taken out: one long line.
                raise ValueError(f"line {n} holds more than one JSON object: put one per line (`curl -d @file` "
                                 "drops a file's line breaks: send it with `--data-binary @file`)") from None
            raise ValueError(f"line {n}: {exc}") from None
        except RecursionError:
            raise ValueError(f"line {n}: nested too deeply") from None
        if isinstance(value, list):
            raise ValueError(f"line {n} is a JSON array: send JSONL, one question object per line")
        try:
            questions.append(GoldenQuestion.model_validate(value))
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(part) for part in first["loc"])
            raise ValueError(f"line {n}: {field + ': ' if field else ''}{first['msg']}") from None
        except RecursionError:
            raise ValueError(f"line {n}: nested too deeply") from None
    if not questions:
        raise ValueError("no questions: one JSON object per line, with `question` and `expected_document`")
    if len(questions) > MAX_QUESTIONS:
        raise ValueError(f"too many questions: {len(questions)} > {MAX_QUESTIONS}")
    return questions


def rank_of(expected: str, hits: list[tuple[str, str]]) -> int | None:
    """1-based rank of the first hit (document_id, filename) from the expected document, else None."""
    for rank, (document_id, filename) in enumerate(hits, 1):
        if expected in (document_id, filename):
            return rank
    return None


def normalise_answer(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).casefold()
    return re.sub(r"[\s,，。.!?？！:：;；'\"“”‘’()（）]+", "", text)


def answer_matches(expected: str, answer: str) -> bool:
    """The expected answer (a short key fact) appears in the answer, ignoring case, spaces and punctuation."""
    return normalise_answer(expected) in normalise_answer(answer)


class QuestionOutcome(BaseModel):
    question: str
    expected_document: str | None = None
    rank: int | None = None           # of the expected document among the top k (in-corpus questions)
    supported: bool                   # the relevance gate let the question through to an answer
    relevance: float                  # the gate's calibrated score of the best passage (0..1)
    top: list[str] = []               # filenames of the top hits, best first
    answer: str | None = None
    answer_correct: bool | None = None
    citation_correct: bool | None = None


class EvaluationReport(BaseModel):
    collection: str
    k: int
    questions: int
    in_corpus: int
    out_of_corpus: int
    recall_at_k: float | None = None
    mrr: float | None = None
    # In-corpus questions the gate let through / out-of-corpus questions it held back (honest refusal).
    answered_in_corpus: float | None = None
    honest_refusals: float | None = None
    answer_accuracy: float | None = None
    citation_correctness: float | None = None
    threshold: float
    # What makes the numbers mean less than they seem: a collection without the tenant's documents, an
    # expected document it does not hold (a misspelt name scores as a miss, not as an error).
    warnings: list[str] = []
    outcomes: list[QuestionOutcome] = []


def summarise(collection: str, k: int, threshold: float, outcomes: list[QuestionOutcome]) -> EvaluationReport:
    inside = [o for o in outcomes if o.expected_document is not None]
    outside = [o for o in outcomes if o.expected_document is None]

    def share(items: list, pred) -> float | None:
        return round(sum(1 for i in items if pred(i)) / len(items), 4) if items else None

    with_answer = [o for o in inside if o.answer_correct is not None]
    with_citation = [o for o in inside if o.citation_correct is not None]
    return EvaluationReport(
        collection=collection, k=k, questions=len(outcomes), in_corpus=len(inside), out_of_corpus=len(outside),
        recall_at_k=share(inside, lambda o: o.rank is not None),
        mrr=round(sum(1 / o.rank for o in inside if o.rank) / len(inside), 4) if inside else None,
        answered_in_corpus=share(inside, lambda o: o.supported),
        honest_refusals=share(outside, lambda o: not o.supported),
        answer_accuracy=share(with_answer, lambda o: o.answer_correct),
        citation_correctness=share(with_citation, lambda o: o.citation_correct),
        threshold=threshold, outcomes=outcomes)


def table(report: EvaluationReport) -> str:
    """The report as a Markdown table (what `make bench` prints)."""
    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    rows = [("questions (in corpus / out of corpus)", f"{report.questions} ({report.in_corpus} / {report.out_of_corpus})"),
            (f"recall@{report.k}", fmt(report.recall_at_k)), ("MRR", fmt(report.mrr)),
            ("in-corpus questions answered (gate open)", fmt(report.answered_in_corpus)),
            ("out-of-corpus questions refused honestly", fmt(report.honest_refusals)),
            ("answer accuracy", fmt(report.answer_accuracy)),
            ("citation correctness", fmt(report.citation_correctness)),
            ("relevance threshold", f"{report.threshold:.2f}")]
    return "\n".join(["| metric | value |", "| --- | --- |", *(f"| {a} | {b} |" for a, b in rows)])
