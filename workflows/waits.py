"""Who in a tree of jobs waits for a person, and what that frees.

A job waits for a person while it is parked for an operator (dead letter) or waits for a review, and
also while every child job it waits on does. A child (an upload's document, a sub-agent) runs within
its parent's running slot, so it tells its parent whenever it starts or stops waiting; the job that
holds the slot lends it while all its children wait, as it does while it waits itself
(workflows/slot.py), and takes it back when one of them has work again. Before this, a document
parked for an operator held its upload's slot for as long as it waited (up to the dead-letter TTL),
and a tenant with a few of them could run nothing else.

When a child resumes, the parent asks for the slot again while the child already runs: until the
parent has it back (at once, unless the tenant is full), the tenant runs one job over its cap per
such parent, rather than hold an operator's retry in line. The parent's own next step waits for the
slot, as after any wait. A document that another upload started is awaited by an activity, not as a
child: its second upload is not told, and keeps its slot while the document waits.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from models.tenancy import ChildWaiting
    from workflows.slot import RunningSlot

# Histories recorded before children told their parents replay without these signals and lendings.
PATCH = "children-lend-parent-slot"
SIGNAL = "child_waiting"


class PersonWaits:
    def __init__(self, slot: RunningSlot, *, within_parent: Callable[[], bool], busy: Callable[[], int] = lambda: 0,
                 on_child: Callable[[str, str | None, bool], None] = lambda child_id, step, waiting: None) -> None:
        """`within_parent`: whether this job runs within its parent's slot (and so tells it); `busy`: how
        many of its activities run now (a job with work under way does not wait, even if one of its
        parallel steps does); `on_child`: told when a child starts or stops waiting for a person (with the
        step that waits on it)."""
        self._slot = slot
        self._within_parent = within_parent
        self._busy = busy
        self._on_child = on_child
        self._own = 0                       # the job's own waits for a person going on now
        self._children: dict[str, str | None] = {}  # children it waits on now, and the step of each
        self._waiting: set[str] = set()     # those of them that wait for a person
        self._heard: dict[str, int] = {}    # the latest signal's seq per child
        self._told = False                  # what the parent was told last
        self._seq = 0
        self._lending: asyncio.Future[None] | None = None

    @asynccontextmanager
    async def own(self) -> AsyncIterator[None]:
        """The job waits for a person: its slot is lent (if it holds one), its parent told."""
        self._own += 1
        self._changed()
        let_go = False
        try:
            async with self._slot.lent(idle=lambda: self._busy() == 0):
                yield
        except GeneratorExit:
            let_go = True  # the worker let go of the workflow and closes its coroutines: no workflow code runs
            raise
        finally:
            if not let_go:
                self._own -= 1
                self._changed()

    @asynccontextmanager
    async def child(self, child_id: str, step: str | None = None) -> AsyncIterator[None]:
        """The job waits on the child job `child_id` for the block (as its step `step`)."""
        if self._lending is None and not self._within_parent() and workflow.patched(PATCH):
            self._lending = asyncio.ensure_future(self._lend_while_children_wait())
        self._children[child_id] = step
        let_go = False
        try:
            yield
        except GeneratorExit:
            let_go = True  # as in `own`
            raise
        finally:
            if not let_go:
                self._children.pop(child_id, None)
                self._waiting.discard(child_id)
                self._changed()

    def heard(self, news: ChildWaiting) -> None:
        """A child's `child_waiting` signal."""
        if news.seq <= self._heard.get(news.job_id, 0):
            return
        self._heard[news.job_id] = news.seq
        if news.job_id not in self._children:
            return
        was = news.job_id in self._waiting
        if news.waiting:
            self._waiting.add(news.job_id)
        else:
            self._waiting.discard(news.job_id)
        if was != news.waiting:
            self._on_child(news.job_id, self._children[news.job_id], news.waiting)
        self._changed()

    def children_wait(self) -> bool:
        return bool(self._children) and self._children.keys() <= self._waiting

    def waiting(self) -> bool:
        """Nothing of the job runs: it, or every child it waits on, waits for a person."""
        return (self._own > 0 or self.children_wait()) and self._busy() == 0

    def recheck(self) -> None:
        """The job's own work started or stopped: tell the parent if that changes whether it waits."""
        self._changed()

    def _changed(self) -> None:
        now = self.waiting()
        if now == self._told or not self._within_parent() or not workflow.patched(PATCH):
            return
        self._told = now
        self._seq += 1
        parent = workflow.info().parent
        news = ChildWaiting(job_id=workflow.info().workflow_id, waiting=now, seq=self._seq)
        asyncio.ensure_future(self._tell(parent.workflow_id, news))

    @staticmethod
    async def _tell(parent_id: str, news: ChildWaiting) -> None:
        try:
            await workflow.get_external_workflow_handle(parent_id).signal(SIGNAL, news)
        except Exception as exc:  # noqa: BLE001 - the parent has ended: nobody to tell
            workflow.logger.info("could not tell the parent job %s: %s", parent_id, exc)

    async def _lend_while_children_wait(self) -> None:
        def idle() -> bool:
            return self.children_wait() and self._busy() == 0

        while True:
            await workflow.wait_condition(idle)
            async with self._slot.lent():
                await workflow.wait_condition(lambda: not idle())
            if self._children:  # one of them has work again, and does it while this job asks for the slot back
                await self._slot.take_back(own_work_waits=False)
