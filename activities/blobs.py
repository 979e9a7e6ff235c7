"""The blob sweep as an activity, so that a Temporal Schedule runs it (workflows/blob_sweep.py)."""

from __future__ import annotations

from temporalio import activity
from temporalio.client import Client

from activities.heartbeats import heartbeating
from models.blobs import SweepInput, SweepReport
from ragline import blob_sweep
from ragline.blobstore import BlobStore
from temporal.errors import translate_errors


class BlobActivities:
    def __init__(self, client: Client, blobs: BlobStore) -> None:
        self.client = client
        self.blobs = blobs

    @activity.defn
    @translate_errors
    async def sweep_blobs(self, req: SweepInput) -> SweepReport:
        """Delete the blobs no workflow Temporal keeps refers to (ragline/blob_sweep.py)."""
        async with heartbeating():
            return await blob_sweep.sweep(self.client, self.blobs, min_age=req.min_age_seconds, dry_run=req.dry_run)
