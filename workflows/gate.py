"""The tenant gate: at most `limit` jobs of one tenant run at once; the others wait queued, in order.

One long-lived workflow per tenant (id `<tenant>.gate.<task queue>`, kind `tenant_gate`, never listed
as a job) holds who runs and who waits. Everything it hears and says is a signal, so a burst of a
tenant's jobs costs it a few workflow tasks, however many jobs there are:

  acquire (from the job's acquire_slot activity, which starts the gate, in a trace of its own, only
           when its signal finds none: a tenant's first job): the job runs at once while fewer than
           `limit` run and nobody waits, otherwise it joins the back of the line; either way the job
           hears its standing (`slot_update`). Past MAX_IN_GATE jobs running or waiting, a new one hears
           that it is refused, and fails (TenantBusy)
  release the job ended, or waits for a person: the next in line hears it may run
  sweep   while anyone waits and every slot is taken: drop holders that ended without releasing
          (terminated by hand), found through the worker's client, every `[running_slots] sweep`
  continue-as-new when the history grows long, carrying holders, the line and their tickets; what
          jobs must hear meanwhile is told by the next run
  answers are signals, at most MAX_SENDING on their way at once

Jobs hold a slot only while they run: see workflows/slot.py for the job's side.
"""

from __future__ import annotations

import asyncio

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.gate import GateActivities
    from models.tenancy import GateState, JobIds, SlotGrant, SlotRequest
    from temporal import policies


FREED_SLOT_PATCH = "gate-grants-a-reasked-slot"  # histories from before replay without the grant
# A gate holding MAX_IN_GATE jobs refuses the next (it fails saying so). Earlier gates queued every job: its
# input, which carries them all through continue-as-new, outgrew Temporal's 2 MB at about 15,000, and the
# gate's every workflow task failed, every job of the tenant waiting for ever.
IN_GATE_BOUND_PATCH = "gate-refuses-past-its-bound"
MAX_IN_GATE = 4000  # job ids of up to 123 characters, each twice (in line, and its ticket): about 1 MB
# At most this many of the gate's answers on their way at once: Temporal fails a workflow task that would
# have more than 2,000 signals pending (a raised limit granting thousands, a burst of thousands of asks).
# Earlier gates sent every answer at once.
MAX_SENDING = 1000
SENDS_BOUNDED_PATCH = "gate-answers-at-most-1000-at-once"
# Histories from before told jobs while ending, and could not end while a steady stream kept them telling.
OWED_PATCH = "gate-ends-without-new-signals"


@workflow.defn
class TenantGateWorkflow:
    @workflow.init
    def __init__(self, state: GateState) -> None:
        self.state = state
        self._notifying = 0
        self._sending = 0
        self._ending = False

    @workflow.run
    async def run(self, state: GateState) -> None:
        owed, self.state.owed = self.state.owed, []
        for job_id in owed:
            if job_id in self.state.holders or job_id in self.state.waiting:
                self._tell(job_id)
        while not self._rotate():
            if self._stuck():
                try:
                    await workflow.wait_condition(lambda: self._rotate() or not self._stuck(),
                                                  timeout=policies.slot_sweep_interval())
                except asyncio.TimeoutError:
                    await self._sweep()
            else:
                await workflow.wait_condition(lambda: self._rotate() or self._stuck())
        # From here on, what jobs must hear waits for the next run: signals sent meanwhile would keep a
        # busy tenant's gate from ever ending (each send must be answered first), until its history is full.
        self._ending = True
        await workflow.wait_condition(lambda: workflow.all_handlers_finished() and not self._notifying)
        workflow.continue_as_new(self.state)

    # -- what jobs send ----------------------------------------------------------------------------
    @workflow.signal
    def acquire(self, req: SlotRequest) -> None:
        state = self.state
        if req.tenant != state.tenant:
            workflow.logger.warning("ignored: job %s of tenant %s asked tenant %s's gate", req.job_id, req.tenant,
                                    state.tenant)
            return
        if req.limit is not None and req.limit != state.limit:
            state.limit = req.limit
            self._grant_next()
        known = req.job_id in state.holders or req.job_id in state.waiting
        # (A job asking again for the slot it lent, its ticket past 1, has run: it is never refused.)
        if not known and req.ticket == 1 and req.refusable and not self._ending and \
                len(state.holders) + len(state.waiting) >= MAX_IN_GATE and workflow.patched(IN_GATE_BOUND_PATCH):
            self._refuse(req)
            return
        if not known or state.tickets.get(req.job_id) != req.ticket:
            # A holder asking with a new ticket lost its release on the way (release_slot gave up): the
            # slot it held goes to the first in line before it queues again, or no one would get it.
            self._drop(req.job_id, grant=workflow.patched(FREED_SLOT_PATCH))
            state.tickets[req.job_id] = req.ticket
            if len(state.holders) < state.limit and not state.waiting:
                state.holders.append(req.job_id)
            else:
                state.waiting.append(req.job_id)
        self._tell(req.job_id)  # asked again (a retried request): the same answer again

    @workflow.signal
    def release(self, req: SlotRequest) -> None:
        if self.state.tickets.get(req.job_id, req.ticket) == req.ticket:
            self._drop(req.job_id)

    @workflow.query
    def slots(self) -> GateState:
        return self.state

    # -- the line ----------------------------------------------------------------------------------
    def _drop(self, job_id: str, *, grant: bool = True) -> None:
        state = self.state
        if job_id in state.holders:
            state.holders.remove(job_id)
        if job_id in state.waiting:
            state.waiting.remove(job_id)
        state.tickets.pop(job_id, None)
        if grant:
            self._grant_next()

    def _grant_next(self) -> None:
        state = self.state
        while state.waiting and len(state.holders) < state.limit:
            job_id = state.waiting.pop(0)
            state.holders.append(job_id)
            self._tell(job_id)

    def _refuse(self, req: SlotRequest) -> None:
        state = self.state
        self._notifying += 1
        asyncio.create_task(self._send(req.job_id, SlotGrant(  # noqa: RUF006 (awaited through _notifying)
            ticket=req.ticket, granted=False, running=len(state.holders), limit=state.limit,
            refused=f"{len(state.holders) + len(state.waiting)} jobs of tenant {state.tenant} already run or wait "
                    f"to run ({state.limit} at once): this one was not queued; send it again once fewer wait (under a new "
                    "Idempotency-Key, if it had one: this one now names this failed job)")))

    def _tell(self, job_id: str) -> None:
        """Signal the job its standing: granted, or its place in line."""
        state = self.state
        if self._ending and workflow.patched(OWED_PATCH):
            if job_id not in state.owed:
                state.owed.append(job_id)
            return
        standing = SlotGrant(ticket=state.tickets.get(job_id, 1), granted=job_id in state.holders,
                             running=len(state.holders), limit=state.limit,
                             position=state.waiting.index(job_id) + 1 if job_id in state.waiting else 0)
        self._notifying += 1
        asyncio.create_task(self._send(job_id, standing))  # noqa: RUF006 (awaited through _notifying)

    async def _send(self, job_id: str, standing: SlotGrant) -> None:
        if self._sending >= MAX_SENDING and workflow.patched(SENDS_BOUNDED_PATCH):
            while self._sending >= MAX_SENDING:  # (woken together, the first to go takes the free place)
                await workflow.wait_condition(lambda: self._sending < MAX_SENDING)
        self._sending += 1
        try:
            await workflow.get_external_workflow_handle(job_id).signal("slot_update", standing)
        except Exception:  # noqa: BLE001 - the job is gone: its place goes to the next in line
            workflow.logger.info("job %s ended before hearing from its gate; passing its place on", job_id)
            if self.state.tickets.get(job_id) == standing.ticket:
                self._drop(job_id)
        finally:
            self._sending -= 1
            self._notifying -= 1

    def _stuck(self) -> bool:
        """Someone waits and every slot is taken: worth checking that the holders still run."""
        return bool(self.state.waiting) and len(self.state.holders) >= self.state.limit

    async def _sweep(self) -> None:
        try:
            ended = await policies.execute(GateActivities.ended_jobs, JobIds(job_ids=list(self.state.holders)))
        except ActivityError as exc:
            # The gate must outlive a server too busy to answer: its holders and line are all it has.
            workflow.logger.warning("could not check the holders (next try in one sweep interval): %s", exc)
            return
        for job_id in ended.job_ids:
            workflow.logger.warning("job %s ended without giving its slot back; freeing it", job_id)
            self._drop(job_id)

    def _rotate(self) -> bool:
        info = workflow.info()
        return info.is_continue_as_new_suggested() or info.get_current_history_length() > self.state.rotate_after
