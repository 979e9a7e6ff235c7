"""The Temporal Schedules Ragline keeps: the blob sweep (ragline/blob_sweep.py)."""

from __future__ import annotations

import dataclasses

from temporalio.client import (
    Client, Schedule, ScheduleActionStartWorkflow, ScheduleAlreadyRunningError, ScheduleIntervalSpec,
    ScheduleOverlapPolicy, SchedulePolicy, ScheduleSpec, ScheduleUpdate, ScheduleUpdateInput,
)
from temporalio.service import RPCError, RPCStatusCode

from models.blobs import SweepInput
from ragline.settings import Settings
from temporal.policies import parse_duration

BLOB_SWEEP = "ragline-blob-sweep"


def blob_sweep_schedule(settings: Settings) -> Schedule:
    return Schedule(
        # By name: temporal/ does not import the workflows (workflows/blob_sweep.py).
        action=ScheduleActionStartWorkflow(
            "BlobSweepWorkflow",
            SweepInput(min_age_seconds=parse_duration(settings.blob_sweep_min_age).total_seconds()),
            id=BLOB_SWEEP, task_queue=settings.task_queue),
        spec=ScheduleSpec(intervals=[ScheduleIntervalSpec(every=parse_duration(settings.blob_sweep_every))]),
        # A sweep still reading a large namespace when the next is due: the next is skipped.
        policy=SchedulePolicy(overlap=ScheduleOverlapPolicy.SKIP),
    )


async def ensure_blob_sweep(client: Client, settings: Settings) -> None:
    """Create the schedule, or bring it to these settings; with RAGLINE_BLOB_SWEEP_EVERY=0, delete it."""
    handle = client.get_schedule_handle(BLOB_SWEEP)
    if parse_duration(settings.blob_sweep_every).total_seconds() == 0:
        try:
            await handle.delete()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
        return
    schedule = blob_sweep_schedule(settings)
    try:
        await client.create_schedule(BLOB_SWEEP, schedule)
    except ScheduleAlreadyRunningError:
        async def to_settings(described: ScheduleUpdateInput) -> ScheduleUpdate | None:
            current = described.description.schedule
            if not await differs(client, current, schedule):
                # An update writes the whole schedule, its state as read here: a pause an operator takes
                # meanwhile (the scheduler takes it a moment after the call) would be undone for nothing.
                return None
            # What an operator set by hand (paused, with a note: README, "Blob sweep") stays: a worker's
            # restart brings the schedule to its settings, not out of a pause.
            return ScheduleUpdate(schedule=dataclasses.replace(schedule, state=current.state))
        await handle.update(to_settings)


async def differs(client: Client, current: Schedule, wanted: Schedule) -> bool:
    """Whether the schedule as the server describes it starts other work, or at other times, than `wanted`."""
    have, want = current.action, wanted.action
    if not (isinstance(have, ScheduleActionStartWorkflow) and isinstance(want, ScheduleActionStartWorkflow)):
        return True
    if (have.workflow, have.id, have.task_queue) != (want.workflow, want.id, want.task_queue):
        return True
    try:  # described arguments are payloads as stored (encrypted, a fresh nonce each time): compare values
        args = await client.data_converter.decode(list(have.args), [type(a) for a in want.args])
    except Exception:  # noqa: BLE001 - e.g. written by an older shape of the input: bring it to this one
        return True
    return args != list(want.args) or current.spec != wanted.spec or current.policy.overlap != wanted.policy.overlap
