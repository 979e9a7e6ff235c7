"""Content-addressed blob store in the data folder (the claim-check side of every workflow).

Blobs are addressed by the sha256 of their bytes, so writing the same bytes twice writes nothing new (it
marks the blob as just put). Writes go to a temp file and are renamed into place, so a crash never
leaves a half-written blob under a valid name. A blob lives while a job Temporal keeps refers to it:
the blob sweep (ragline/blob_sweep.py) deletes the others once nothing has put them for a while.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from ragline.errors import InputError

REF_PREFIX = "sha256:"
_DIGEST = re.compile(r"[0-9a-f]{64}")


class BlobNotFound(InputError):
    """Bytes a job refers to are not in the store: lost with a disk, or a blob folder not shared by every
    process. Not retried: no attempt brings them back; the job fails, naming the reference."""

    def __init__(self, ref: str) -> None:
        super().__init__(f"{ref} is not in the blob store: lost, or the blob folder is not the one every "
                         "process shares (RAGLINE_DATA_DIR)")
        self.ref = ref


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._quarantine = self.root / "quarantine"

    def _path(self, ref: str) -> Path:
        if not ref.startswith(REF_PREFIX):
            raise ValueError(f"not a blob reference: {ref!r}")
        digest = ref[len(REF_PREFIX):]
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"not a blob reference: {ref!r}")
        return self.root / digest[:2] / digest

    def put(self, data: bytes) -> str:
        ref = REF_PREFIX + hashlib.sha256(data).hexdigest()
        path = self._path(ref)
        if not _touch(path):
            self._write_atomically(path, data)
        return ref

    def put_stream(self, stream: BinaryIO, *, limit: int | None = None, chunk: int = 1 << 20) -> tuple[str, int]:
        """Copy a stream in, hashing as it goes. Raises OverflowError past `limit` bytes."""
        digest = hashlib.sha256()
        size = 0
        tmp_dir = self.root / "tmp"
        tmp_dir.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=tmp_dir)
        try:
            with os.fdopen(fd, "wb") as out:
                while block := stream.read(chunk):
                    size += len(block)
                    if limit is not None and size > limit:
                        raise OverflowError(size)
                    digest.update(block)
                    out.write(block)
                out.flush()
                os.fsync(out.fileno())
            ref = REF_PREFIX + digest.hexdigest()
            path = self._path(ref)
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, path)
            # An upload is answered 202 once stored: its new name must survive a power cut too.
            _sync_folder(path.parent)
            return ref, size
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get(self, ref: str) -> bytes:
        for _ in range(2):
            try:
                return self._path(ref).read_bytes()
            except FileNotFoundError:
                if not self._restore(ref):  # set aside by the sweep: back in place, and read
                    break
        raise BlobNotFound(ref)

    def get_if_starts_with(self, ref: str, starts: tuple[bytes, ...]) -> bytes | None:
        """The blob's bytes if they start with one of `starts` (None otherwise, or if it is not in place):
        reads one byte of a blob that does not."""
        for _ in range(2):
            try:
                with self._path(ref).open("rb") as f:
                    head = f.read(1)
                    return head + f.read() if head[:1] and head.startswith(starts) else None
            except FileNotFoundError:
                if not self._restore(ref):
                    break
        return None

    def exists(self, ref: str) -> bool:
        return self._path(ref).exists()

    def stored(self) -> Iterator[tuple[str, os.stat_result]]:
        """Every blob: its reference and its file's stat (st_mtime: when it was last put)."""
        for shard in sorted(self.root.iterdir()):
            if len(shard.name) != 2 or not shard.is_dir():
                continue
            for entry in os.scandir(shard):
                if _DIGEST.fullmatch(entry.name):
                    try:
                        yield REF_PREFIX + entry.name, entry.stat()
                    except FileNotFoundError:
                        continue

    def leftovers(self) -> Iterator[tuple[Path, os.stat_result]]:
        """Temp files a crashed write left behind (an upload cut off, a worker killed mid-put)."""
        for folder in sorted(self.root.iterdir()):
            if not folder.is_dir() or not (folder.name == "tmp" or len(folder.name) == 2):  # not quarantine/
                continue
            for entry in os.scandir(folder):
                if entry.is_file() and not _DIGEST.fullmatch(entry.name):
                    try:
                        yield Path(entry.path), entry.stat()
                    except FileNotFoundError:
                        continue

    # -- the sweep's two steps (ragline/blob_sweep.py) ------------------------------------------------
    # A blob nobody refers to is first set aside (renamed into quarantine/), and deleted only by a later
    # sweep that still finds it unreferenced and not put since. Deleting at once is not safe on a shared
    # network volume: a pod whose client still holds the blob's old name (NFS caches lookups for up to a
    # minute) puts the same bytes by touching the file the sweep has just renamed, believing them stored.
    # Set aside, that touch is seen by the next sweep, which puts the blob back; and a get() meanwhile
    # finds it there and puts it back at once.

    def set_aside(self, ref: str, since: float) -> int | None:
        """Move the blob to quarantine unless it was put at or after `since` (a time.time()): its size, or
        None if kept. A put after the move finds nothing at the blob's name, and writes the bytes anew."""
        path = self._path(ref)
        try:
            stat = path.stat()
            if stat.st_mtime >= since:
                return None
            self._quarantine.mkdir(exist_ok=True)
            os.rename(path, self._quarantine / path.name)
        except FileNotFoundError:
            return None
        return stat.st_size

    def quarantined(self) -> Iterator[tuple[str, os.stat_result]]:
        if not self._quarantine.is_dir():
            return
        for entry in os.scandir(self._quarantine):
            if _DIGEST.fullmatch(entry.name):
                try:
                    yield REF_PREFIX + entry.name, entry.stat()
                except FileNotFoundError:
                    continue

    def settle(self, ref: str, *, needed: bool, since: float) -> int | None:
        """A blob set aside by an earlier sweep: back in place if `needed` (a job refers to it again) or put
        since `since` (its touch landed on the quarantined file), else deleted: its size when deleted."""
        aside = self._quarantine / ref[len(REF_PREFIX):]
        try:
            stat = aside.stat()
            if needed or stat.st_mtime >= since or self._path(ref).exists():  # (the last: written anew)
                self._restore(ref)
                return None
            aside.unlink()
        except FileNotFoundError:  # restored by a get(), or settled by another sweep
            return None
        return stat.st_size

    def _restore(self, ref: str) -> bool:
        path = self._path(ref)
        try:
            if path.exists():  # written anew meanwhile: the same bytes
                (self._quarantine / path.name).unlink(missing_ok=True)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                os.replace(self._quarantine / path.name, path)
        except FileNotFoundError:
            return False
        return True

    def put_json(self, obj: Any) -> str:
        return self.put(json.dumps(obj, ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode())

    def get_json(self, ref: str) -> Any:
        return json.loads(self.get(ref))

    def _write_atomically(self, path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _touch(path: Path) -> bool:
    """Mark a stored blob as just put, so the sweep spares it; False if it is not there."""
    try:
        os.utime(path)
        return True
    except FileNotFoundError:
        return False


def _sync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
