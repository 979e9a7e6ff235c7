"""Content-addressed blob store in the data folder (the claim-check side of every workflow).

Blobs are addressed by the sha256 of their bytes, so writing the same bytes twice is a no-op and a
reference is valid forever. Writes go to a temp file and are renamed into place, so a crash never
leaves a half-written blob under a valid name.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

REF_PREFIX = "sha256:"


class BlobNotFound(KeyError):
    pass


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

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
        if not path.exists():
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
            return ref, size
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get(self, ref: str) -> bytes:
        try:
            return self._path(ref).read_bytes()
        except FileNotFoundError:
            raise BlobNotFound(ref) from None

    def exists(self, ref: str) -> bool:
        return self._path(ref).exists()

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
