"""The job's side of its tenant's gate (workflows/gate.py), through the worker's Temporal client."""

from __future__ import annotations

import asyncio

from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from models.tenancy import GateState, JobIds, SlotRequest, workflow_id
from ragline import tracing
from ragline.keys import KeyRing
from ragline.settings import Settings
from temporal import policies, queues
from temporal import search_attributes as sa
from temporal.errors import translate_errors

GATE_WORKFLOW = "TenantGateWorkflow"


def gate_id(tenant: str, task_queue: str) -> str:
    """One gate per tenant and deployment (its task queue): deployments sharing a namespace keep apart."""
    return workflow_id(tenant, f"gate.{task_queue}")


class GateActivities:
    def __init__(self, client: Client, settings: Settings) -> None:
        self.client = client
        self.settings = settings
        self.keys = KeyRing(settings.effective_api_keys_file)

    def limit(self, tenant: str) -> int:
        """`[tenants.<name>] max_running_jobs` in the keys file, else RAGLINE_TENANT_MAX_RUNNING_JOBS."""
        return self.keys.limits(tenant).max_running_jobs or self.settings.tenant_max_running_jobs

    @activity.defn
    @translate_errors
    async def acquire_slot(self, req: SlotRequest) -> None:
        """Ask the tenant's gate for a running slot; the tenant's first job starts its gate. The answer comes
        back to the job as the gate's `slot_update` signal."""
        limit = self.limit(req.tenant)
        gate = self.client.get_workflow_handle(gate_id(req.tenant, self.settings.task_queue))
        request = req.model_copy(update={"limit": limit})
        try:
            await gate.signal("acquire", request)
            return
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
        # No gate runs: start one, in a trace of its own. A gate serves the tenant's jobs for as long as it
        # runs (it continues as new): started in this job's trace, every later job's signal would land there.
        with tracing.own_trace("tenant gate"):
            try:
                await self.client.start_workflow(
                    GATE_WORKFLOW, GateState(tenant=req.tenant, limit=limit), id=gate.id,
                    task_queue=queues.queue_name(self.settings.task_queue, "main"),
                    priority=policies.workflow_priority("tenant_gate"),
                    search_attributes=TypedSearchAttributes([SearchAttributePair(sa.JOB_KIND, "tenant_gate"),
                                                             SearchAttributePair(sa.TENANT, req.tenant)]))
            except WorkflowAlreadyStartedError:
                pass  # another of the tenant's jobs started it a moment ago
        await gate.signal("acquire", request)

    @activity.defn
    @translate_errors
    async def release_slot(self, req: SlotRequest) -> None:
        try:
            await self.client.get_workflow_handle(gate_id(req.tenant, self.settings.task_queue)).signal("release", req)
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:  # no gate: nothing is held
                raise

    @activity.defn
    @translate_errors
    async def ended_jobs(self, req: JobIds) -> JobIds:
        """Which of these jobs are no longer running (the gate frees their slots)."""
        async def ended(job_id: str) -> bool:
            try:
                desc = await self.client.get_workflow_handle(job_id).describe()
            except RPCError as exc:
                if exc.status == RPCStatusCode.NOT_FOUND:
                    return True
                raise
            return desc.status != WorkflowExecutionStatus.RUNNING

        flags = await asyncio.gather(*(ended(j) for j in req.job_ids))
        return JobIds(job_ids=[j for j, gone in zip(req.job_ids, flags, strict=True) if gone])
