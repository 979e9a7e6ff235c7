"""BlobSweepWorkflow: sweep_blobs, once. A Temporal Schedule (temporal/schedules.py) starts it every
RAGLINE_BLOB_SWEEP_EVERY; the Web UI lists its runs and their reports under the schedule."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.blobs import BlobActivities
    from models.blobs import SweepInput, SweepReport
    from temporal import policies


@workflow.defn
class BlobSweepWorkflow:
    @workflow.run
    async def run(self, req: SweepInput) -> SweepReport:
        return await policies.execute(BlobActivities.sweep_blobs, req)
