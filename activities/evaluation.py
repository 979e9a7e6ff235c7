"""The evaluation job's step: every golden question through the same retrieval, relevance gate and (when
asked) answer generation that a chat turn uses, scored by ragline/evaluation.py."""

from __future__ import annotations

import asyncio

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.chat import cited_passages
from activities.heartbeats import heartbeating
from activities.search import find_passages, no_documents_warnings
from models.evaluation import EvaluationInput, EvaluationOutput
from ragline import evaluation, prompts, relevance
from ragline.blobstore import BlobStore
from ragline.errors import RaglineError
from ragline.embeddings import Embedder
from ragline.llm import ChatModel
from ragline.settings import Settings
from ragline.vectorstore import VectorIndex
from temporal.errors import translate_errors

# Outcomes without a model answer are cheap to redo: kept (for a retried attempt) this many at a time.
CHECKPOINT_EVERY = 50


class EvaluationActivities:
    def __init__(self, settings: Settings, blobs: BlobStore, embedder: Embedder, index: VectorIndex,
                 model: ChatModel) -> None:
        self.settings = settings
        self.blobs = blobs
        self.embedder = embedder
        self.index = index
        self.model = model

    @activity.defn
    @translate_errors
    async def evaluate_collection(self, req: EvaluationInput) -> EvaluationOutput:
        questions = evaluation.parse_jsonl((await asyncio.to_thread(self.blobs.get, req.questions_ref)).decode("utf-8"))
        threshold = relevance.threshold(self.settings.relevance_threshold)
        # A retried attempt goes on after the questions an earlier one checkpointed, and so does an
        # operator's retry (the workflow hands them on): their answers are not asked (and paid for) again.
        checkpoints: list[str] = list((activity.info().heartbeat_details or [{}])[0].get("checkpoints")
                                      or req.checkpoints)
        outcomes = [evaluation.QuestionOutcome.model_validate(o) for ref in checkpoints
                    for o in await asyncio.to_thread(self.blobs.get_json, ref)]
        resumed = len(outcomes)
        unsaved: list[evaluation.QuestionOutcome] = []
        try:
            for n, q in enumerate(questions, 1):
                if n <= resumed:
                    continue
                outcome = await self._outcome(req, q, threshold, progress={"checkpoints": checkpoints, "done": n - 1})
                unsaved.append(outcome)
                if outcome.answer is not None or len(unsaved) >= CHECKPOINT_EVERY:  # a model answer is worth keeping
                    checkpoints.append(await asyncio.to_thread(
                        self.blobs.put_json, [o.model_dump(mode="json") for o in unsaved]))
                    outcomes += unsaved
                    unsaved = []
                activity.heartbeat({"checkpoints": checkpoints, "done": n})
        except RaglineError as exc:  # the step's failure carries what it saved, for an operator's retry
            exc.details = {**exc.details, "checkpoints": checkpoints}
            raise
        except Exception as exc:  # not one of ours (a store's client, a bug): retried as it would be, saves kept
            raise ApplicationError(str(exc), {"checkpoints": checkpoints}, type=type(exc).__name__) from exc
        outcomes += unsaved
        report = evaluation.summarise(req.collection, req.k, threshold, outcomes)
        report.warnings = await asyncio.to_thread(self._warnings, req, questions)
        ref = await asyncio.to_thread(self.blobs.put, report.model_dump_json().encode("utf-8"))
        return EvaluationOutput(report=report.model_copy(update={"outcomes": []}), report_ref=ref,
                                attempt=activity.info().attempt)

    def _warnings(self, req: EvaluationInput, questions: list[evaluation.GoldenQuestion]) -> list[str]:
        if warnings := no_documents_warnings(self.index, req.tenant, req.collection, []):
            return warnings
        expected = sorted({q.expected_document for q in questions if q.expected_document})
        missing = [name for name in expected if not self.index.has_document(req.tenant, req.collection, name)]
        if not missing:
            return []
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        return [f"expected_document names no document of collection {req.collection} (its id, or its file name "
                f"as uploaded): {shown}; their questions count as misses"]

    async def _outcome(self, req: EvaluationInput, q: evaluation.GoldenQuestion, threshold: float, *,
                       progress: dict) -> evaluation.QuestionOutcome:
        """One golden question: retrieved, and answered when asked. While the model answers, heartbeats carry
        `progress` (the checkpoints so far: they replace the details) and hear of a cancel."""
        hits = await asyncio.to_thread(find_passages, self.embedder, self.index, req.tenant, req.collection,
                                       q.question, req.k)
        rank = evaluation.rank_of(q.expected_document, [(h.document_id, h.filename) for h in hits]) \
            if q.expected_document else None
        best = max((h.relevance for h in hits), default=0.0)
        outcome = evaluation.QuestionOutcome(
            question=q.question, expected_document=q.expected_document, rank=rank, supported=best >= threshold,
            relevance=best, top=[h.filename for h in hits])
        if req.answers and q.in_corpus:
            if outcome.supported:
                async with heartbeating(lambda: progress):
                    reply = await self.model.complete(prompts.messages(
                        "answer", passages=prompts.format_passages(hits), history="(none)", question=q.question),
                        step="evaluate")
                outcome.answer = reply.text.strip()
                cited = [hits[i - 1] for i in cited_passages(outcome.answer, hits)]
                outcome.citation_correct = any(q.expected_document in (h.document_id, h.filename) for h in cited)
            else:
                outcome.answer, outcome.citation_correct = prompts.not_covered_answer(q.question), False
            if q.expected_answer:
                outcome.answer_correct = evaluation.answer_matches(q.expected_answer, outcome.answer)
        return outcome
