"""The job's side of its tenant's gate (workflows/gate.py), through the worker's Temporal client."""

from __future__ import annotations

import asyncio

from temporalio import activity
from temporalio.client import Client, WithStartWorkflowOperation, WorkflowExecutionStatus
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode

from models.tenancy import GateState, JobIds, SlotGrant, SlotRequest, workflow_id
from ragline.keys import KeyRing
from ragline.settings import Settings
from temporal import queues
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
    async def acquire_slot(self, req: SlotRequest) -> SlotGrant:
        """Ask the tenant's gate for a running slot, starting the gate if this is its first job."""
        limit = self.limit(req.tenant)
        start = WithStartWorkflowOperation(
            GATE_WORKFLOW, GateState(tenant=req.tenant, limit=limit), id=gate_id(req.tenant, self.settings.task_queue),
            task_queue=queues.queue_name(self.settings.task_queue, "main"),
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            search_attributes=TypedSearchAttributes([SearchAttributePair(sa.JOB_KIND, "tenant_gate"),
                                                     SearchAttributePair(sa.TENANT, req.tenant)]))
        return await self.client.execute_update_with_start_workflow(
            "acquire", req.model_copy(update={"limit": limit}), start_workflow_operation=start, result_type=SlotGrant)

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

    def all(self) -> list:
        return [self.acquire_slot, self.release_slot, self.ended_jobs]
