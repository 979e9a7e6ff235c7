"""A job's running slot: at most RAGLINE_TENANT_MAX_RUNNING_JOBS jobs of a tenant run at once
(`[tenants.<name>] max_running_jobs` in the keys file overrides it per tenant); the others wait
`queued`, in order of asking, and none is refused. The tenant's gate (workflows/gate.py) keeps count.

Who takes a slot: a job nobody started but the API (ingest requests, agents, evaluations) and every
chat turn (its parent, the session, holds none). A job another job started (an ingest's documents, a
sub-agent) runs within its parent's slot: were it to wait for one of its own, a full tenant whose
running jobs all wait on their children would never move. A job lends its slot while it waits for a
person (review, dead letter), or while all the children it waits on do (workflows/waits.py), and
queues again for one only when it has more work to run (`take_back`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.gate import GateActivities
    from models.tenancy import SlotGrant, SlotRequest
    from temporal import policies
    from temporal import search_attributes as sa
    from workflows.events import JobEvents

PATCH = "tenant-running-slots"  # histories from before slots replay without them
# Histories from before a lent slot was taken back only for more work replay taking it back at the decision.
LENT_PATCH = "slot-taken-back-for-work"
# Histories from before a second take_back waited for the first one's ask replay it going on at once.
RETAKE_PATCH = "slot-retake-awaited"
# Histories from before a grant was final replay a late "wait in line" undoing it.
GRANT_FINAL_PATCH = "slot-grant-is-final"
# Histories from before a job with work still running lent its slot only once that work ended replay it lent
# at once.
LEND_WHEN_IDLE_PATCH = "slot-lent-once-work-ends"


class RunningSlot:
    def __init__(self, events: JobEvents, on_change: Callable[[], None],
                 on_held: Callable[[timedelta], None] = lambda waited: None) -> None:
        self._events = events
        self._on_change = on_change
        self._on_held = on_held  # told, once the slot is held, how long asking for it took
        self._ticket = 0
        self._standing: SlotGrant | None = None
        self._asked = False    # the gate knows of this job (holding, or in line)
        self._sending = False  # the request is on its way to the gate
        self.held = False
        self.waiting = False   # told to wait in line
        self.owed = False      # lent to a person's wait: taken back before the job's next piece of work
        self._retaking = False  # a take_back is asking for the slot now
        self._withdrawals = 0  # an ask withdrawn while it was on its way or in line stops waiting
        self._lending = False  # the slot is being given back to lend it

    def heard(self, standing: SlotGrant) -> None:
        """The gate's `slot_update` signal: granted, or the place in line (of the latest request only). A
        grant is final for its request: the gate's answers are signals of their own, which the server may
        deliver out of order, and a "wait in line" sent before the grant must not undo it (the job would
        wait for ever, holding the slot the gate gave it)."""
        if standing.ticket != self._ticket:
            return
        if self._standing is not None and self._standing.granted and not standing.granted \
                and workflow.patched(GRANT_FINAL_PATCH):
            return
        self._standing = standing

    async def acquire(self, *, takes_slot: bool, own_work_waits: bool = True) -> None:
        """`own_work_waits`: the job's own next piece of work waits for the slot (told `on_held` how long it
        took); False when others work meanwhile (a job's children, while it takes back the slot it lent)."""
        tenant = workflow.info().typed_search_attributes.get(sa.TENANT)
        # Jobs started by hand without Ragline's search attributes (or on a server without them) run
        # outside any gate.
        if not takes_slot or tenant is None or not workflow.patched(PATCH):
            return
        asked_at = workflow.now()
        self._ticket += 1
        self._standing = None
        self._asked = self._sending = True
        withdrawals = self._withdrawals
        try:
            # An activity, not a local one: the job's workflow task does not wait for it, so a turn's
            # retrieval is scheduled at once, and asks in parallel.
            await policies.execute(GateActivities.acquire_slot, self._request(tenant))
        finally:
            self._sending = False
        def withdrawn() -> bool:
            return self._withdrawals != withdrawals

        await workflow.wait_condition(lambda: self._standing is not None or withdrawn())
        if withdrawn():
            return
        if self._standing.refused is not None:  # the gate holds all it may: nothing to give back
            self._asked = False
            raise ApplicationError(self._standing.refused, type="TenantBusy", non_retryable=True)
        if not self._standing.granted:
            self.waiting = True
            self._on_change()
            self._events.emit("ragline.job.queued", {
                "reason": "tenant_running_jobs", "running": self._standing.running, "limit": self._standing.limit,
                "position": self._standing.position})
            await workflow.wait_condition(lambda: self._standing.granted or withdrawn())
            self.waiting = False
            self._on_change()
            if withdrawn():
                return
        self.held = True
        if own_work_waits:
            self._on_held(workflow.now() - asked_at)

    async def release(self) -> None:
        """Give the slot back (or leave the line). Never fails the job: the gate's sweep frees a slot
        whose release was lost."""
        if not self._asked:
            return
        await workflow.wait_condition(lambda: not self._sending)  # so the release cannot overtake it
        self._asked = self.held = self.waiting = False
        try:
            tenant = workflow.info().typed_search_attributes.get(sa.TENANT)
            await policies.execute_local(GateActivities.release_slot, self._request(tenant))
        except Exception as exc:  # noqa: BLE001
            workflow.logger.warning("could not give the running slot back (the gate will find out): %s", exc)

    @asynccontextmanager
    async def lent(self, idle: Callable[[], bool] = lambda: True) -> AsyncIterator[None]:
        """While the job waits for a person, another job may run in its slot: the slot is given back, or
        the ask for one withdrawn (a step can fail while the slot is still being asked for). The job
        asks again only when it has work for it (`take_back`): a decision that ends the job needs no
        slot, and the person's decision is recorded the moment it comes, not once a slot is free.
        `idle`: whether none of the job's work runs. Work that still runs (a chat turn's summary while its
        answer waits for a reviewer) keeps the slot until it ends, or the tenant would run over its cap."""
        if not workflow.patched(LENT_PATCH):
            async with self._lent_until_decided():
                yield
            return
        if not idle() and self._asked and workflow.patched(LEND_WHEN_IDLE_PATCH):
            async with self._lent_while_idle(idle):
                yield
            return
        await self._lend()
        yield

    async def _lend(self) -> None:
        # Two waits for a person can begin together (a review, and a step parked beside it): one gives the slot
        # back, the other waits until it is given back (owed), so that the next piece of work takes it again.
        if self._lending and workflow.patched(LEND_WHEN_IDLE_PATCH):
            await workflow.wait_condition(lambda: not self._lending)
            return
        if not self._asked:
            return
        self._lending = True
        try:
            self._withdrawals += 1
            await self.release()
            self.owed = True
        finally:
            self._lending = False

    @asynccontextmanager
    async def _lent_while_idle(self, idle: Callable[[], bool]) -> AsyncIterator[None]:
        over = False

        async def lend_whenever_idle() -> None:
            # Again after each take-back: a step parked beside the wait, retried by an operator, ends.
            while True:
                await workflow.wait_condition(lambda: over or (idle() and self._asked and not self._retaking))
                if over:
                    return
                await self._lend()

        lending = asyncio.ensure_future(lend_whenever_idle())
        let_go = False
        try:
            yield
        except GeneratorExit:
            let_go = True  # the worker let go of the workflow and closes its coroutines: nothing may wait now
            raise
        finally:
            over = True
            if not let_go:
                await lending  # a release under way ends first: the next piece of work takes the slot back after it

    async def take_back(self, *, own_work_waits: bool = True) -> None:
        """Before the job's next piece of work: the slot it lent, if it lent one. Work that comes while
        another take_back is still asking (in line at a full gate) waits for that ask too.
        `own_work_waits` as `acquire` takes it."""
        if self._lending and workflow.patched(LEND_WHEN_IDLE_PATCH):
            # A lend under way (its release not yet sent): once it is given back (owed), it is asked for again.
            await workflow.wait_condition(lambda: not self._lending)
        while True:
            if self.owed:
                self.owed = False
                self._retaking = True
                try:
                    await self.acquire(takes_slot=True, own_work_waits=own_work_waits)
                finally:
                    self._retaking = False
                return
            if not (self._retaking and workflow.patched(RETAKE_PATCH)):
                return
            await workflow.wait_condition(lambda: not self._retaking)  # then: held, or lent again (owed)

    @asynccontextmanager
    async def _lent_until_decided(self) -> AsyncIterator[None]:
        """How histories recorded before LENT_PATCH lent a slot: given back while a person decides, and
        asked for again as soon as the decision came."""
        if not self.held:
            yield
            return
        await self.release()
        yield  # a failure here ends the job: no slot to take again
        await self.acquire(takes_slot=True)

    def _request(self, tenant: str) -> SlotRequest:
        return SlotRequest(tenant=tenant, job_id=workflow.info().workflow_id, ticket=self._ticket, refusable=True)
