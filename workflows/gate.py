"""The tenant gate: at most `limit` jobs of one tenant run at once; the others wait queued, in order.

One long-lived workflow per tenant (id `<tenant>.gate.<task queue>`, kind `tenant_gate`, never listed
as a job) holds who runs and who waits:

  acquire (Update, sent with update-with-start by the job's first local activity, so a tenant's first
           job starts its gate): granted at once while fewer than `limit` run and nobody waits,
           otherwise queued at the back of the line (asking again is harmless: same answer)
  release (Signal): the job ended, or waits for a person; the next in line gets `slot_granted`
  sweep   while anyone waits and every slot is taken: drop holders that ended without releasing
          (terminated by hand), found through the worker's client, every `slot_sweep` interval
  continue-as-new when the history grows long, carrying holders and the line

Jobs hold a slot only while they run: see workflows/slot.py for the job's side.
"""

from __future__ import annotations

import asyncio

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.gate import GateActivities
    from models.tenancy import GateState, JobIds, SlotGrant, SlotRequest
    from temporal import policies


@workflow.defn
class TenantGateWorkflow:
    @workflow.init
    def __init__(self, state: GateState) -> None:
        self.state = state
        self._notifying = 0

    @workflow.run
    async def run(self, state: GateState) -> None:
        while not self._rotate():
            if self._stuck():
                try:
                    await workflow.wait_condition(lambda: self._rotate() or not self._stuck(),
                                                  timeout=policies.slot_sweep_interval())
                except asyncio.TimeoutError:
                    await self._sweep()
            else:
                await workflow.wait_condition(lambda: self._rotate() or self._stuck())
        await workflow.wait_condition(lambda: workflow.all_handlers_finished() and not self._notifying)
        workflow.continue_as_new(self.state)

    # -- what jobs send ----------------------------------------------------------------------------
    @workflow.update
    def acquire(self, req: SlotRequest) -> SlotGrant:
        state = self.state
        if req.limit is not None and req.limit != state.limit:
            state.limit = req.limit
            self._grant_next()
        if req.job_id not in state.holders and req.job_id not in state.waiting:
            if len(state.holders) < state.limit and not state.waiting:
                state.holders.append(req.job_id)
            else:
                state.waiting.append(req.job_id)
        if req.job_id in state.holders:
            return SlotGrant(granted=True, running=len(state.holders), limit=state.limit)
        return SlotGrant(granted=False, running=len(state.holders), limit=state.limit,
                         position=state.waiting.index(req.job_id) + 1)

    @acquire.validator
    def _validate_acquire(self, req: SlotRequest) -> None:
        if req.tenant != self.state.tenant:
            raise ApplicationError(f"this gate is tenant {self.state.tenant}'s, not {req.tenant}'s",
                                   type="InputError")

    @workflow.signal
    def release(self, req: SlotRequest) -> None:
        self._drop(req.job_id)

    @workflow.query
    def slots(self) -> GateState:
        return self.state

    # -- the line ----------------------------------------------------------------------------------
    def _drop(self, job_id: str) -> None:
        if job_id in self.state.holders:
            self.state.holders.remove(job_id)
        if job_id in self.state.waiting:
            self.state.waiting.remove(job_id)
        self._grant_next()

    def _grant_next(self) -> None:
        state = self.state
        while state.waiting and len(state.holders) < state.limit:
            job_id = state.waiting.pop(0)
            state.holders.append(job_id)
            self._notifying += 1
            asyncio.create_task(self._notify(job_id))  # noqa: RUF006 (awaited through _notifying)

    async def _notify(self, job_id: str) -> None:
        try:
            await workflow.get_external_workflow_handle(job_id).signal("slot_granted")
        except Exception:  # noqa: BLE001 - the job is gone: its slot goes to the next in line
            workflow.logger.info("job %s ended before its slot came; passing it on", job_id)
            self._drop(job_id)
        finally:
            self._notifying -= 1

    def _stuck(self) -> bool:
        """Someone waits and every slot is taken: worth checking that the holders still run."""
        return bool(self.state.waiting) and len(self.state.holders) >= self.state.limit

    async def _sweep(self) -> None:
        check = GateActivities.ended_jobs
        ended = await workflow.execute_activity_method(check, JobIds(job_ids=list(self.state.holders)),
                                                       **policies.options(policies.activity_name(check)))
        for job_id in ended.job_ids:
            workflow.logger.warning("job %s ended without giving its slot back; freeing it", job_id)
            self._drop(job_id)

    def _rotate(self) -> bool:
        info = workflow.info()
        return info.is_continue_as_new_suggested() or info.get_current_history_length() > self.state.rotate_after
