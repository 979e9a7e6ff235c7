"""Evaluation: golden questions for a collection -> recall@k, MRR, honest refusals, answer accuracy.

POST /v1/evaluations stores the JSONL in the blob store and starts this job (kind `evaluation`, the
collection in RaglineCollection); its result is the report, listed by GET /v1/evaluations from visibility.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.evaluation import EvaluationActivities
    from models.evaluation import EvaluationInput, EvaluationOutput
    from workflows.job import JobWorkflow


@workflow.defn
class EvaluationWorkflow(JobWorkflow):
    PLANNED = (EvaluationActivities.evaluate_collection,)

    @workflow.run
    async def run(self, req: EvaluationInput) -> EvaluationOutput:
        return await self.run_job(lambda: self.step(EvaluationActivities.evaluate_collection, req),
                                  accepted={"collection": req.collection, "questions": req.questions})
