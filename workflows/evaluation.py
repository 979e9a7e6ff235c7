"""Evaluation: golden questions for a collection -> recall@k, MRR, honest refusals, answer accuracy.

POST /v1/evaluations stores the JSONL in the blob store and starts this job (kind `evaluation`, the
collection in RaglineCollection); its result is the report, listed by GET /v1/evaluations from visibility.
"""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError

with workflow.unsafe.imports_passed_through():
    from activities.evaluation import EvaluationActivities
    from models.evaluation import EvaluationInput, EvaluationOutput
    from workflows.job import JobWorkflow


@workflow.defn
class EvaluationWorkflow(JobWorkflow):
    PLANNED = (EvaluationActivities.evaluate_collection,)

    @workflow.run
    async def run(self, req: EvaluationInput) -> EvaluationOutput:
        return await self.run_job(lambda: self.step(EvaluationActivities.evaluate_collection, req, resume=_resume),
                                  accepted={"collection": req.collection, "questions": req.questions})


def _resume(req: EvaluationInput, error: ActivityError) -> EvaluationInput:
    """An operator's retry goes on from the outcomes the last round saved: its failure carries them (a
    model error) or its last heartbeat did (a timeout)."""
    cause = error.cause
    carried = None
    if isinstance(cause, ApplicationError):
        carried = cause.details
    elif isinstance(cause, TimeoutError):
        carried = cause.last_heartbeat_details
    saved = carried[0].get("checkpoints") if carried and isinstance(carried[0], dict) else None
    return req.model_copy(update={"checkpoints": list(saved)}) if saved else req
