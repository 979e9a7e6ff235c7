"""The blob sweep's input and report (ragline/blob_sweep.py, workflows/blob_sweep.py)."""

from __future__ import annotations

from pydantic import BaseModel


class SweepInput(BaseModel):
    # Spare blobs put more recently than this: longer than any activity takes to report a blob it put.
    min_age_seconds: float
    dry_run: bool = False


class SweepReport(BaseModel):
    workflows_read: int = 0
    referenced: int = 0  # references found (some may name a blob already gone)
    stored: int = 0  # in place (not counting those set aside)
    set_aside: int = 0  # unreferenced and old: moved to quarantine, for the next sweep to delete
    bytes_set_aside: int = 0
    deleted: int = 0  # set aside by an earlier sweep and still unreferenced, not put since
    bytes_freed: int = 0
    restored: int = 0  # set aside by an earlier sweep, and referred to (or put) again since: back in place
    kept_young: int = 0  # unreferenced, but put within the minimum age
    leftovers_deleted: int = 0  # temp files of writes cut off
    dry_run: bool = False
    seconds: float = 0.0
