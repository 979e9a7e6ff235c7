"""The Temporal Schedules Ragline keeps: the blob sweep (ragline/blob_sweep.py)."""

from __future__ import annotations

import dataclasses

from temporalio.client import (
    Client, Schedule, ScheduleActionStartWorkflow, ScheduleAlreadyRunningError, ScheduleIntervalSpec,
    ScheduleOverlapPolicy, SchedulePolicy, ScheduleSpec, ScheduleUpdate,
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
        # What an operator set by hand (paused, with a note: README, "Blob sweep") stays: a worker's restart
        # brings the schedule to its settings, not out of a pause.
        await handle.update(lambda described: ScheduleUpdate(
            schedule=dataclasses.replace(schedule, state=described.description.schedule.state)))
