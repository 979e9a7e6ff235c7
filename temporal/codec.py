"""AES-256-GCM payload encryption (a Temporal `PayloadCodec`), with several keys loadable at once.

Every payload is encrypted with the *current* key; its id travels in the payload's metadata
(`encryption-key-id`), so after a rotation (a new current key, old keys kept) old histories stay
readable. Payload data is a 12-byte nonce followed by the ciphertext of the serialized original
payload; the key id is bound as associated data.

Decoding is strict: a payload that is not marked `binary/encrypted` is never read as what it says,
so nothing written in plain text (by a misconfigured client, or by someone signalling a workflow by
hand without the codec) is ever accepted as input. It is handed on marked `ragline/unencrypted`, an
encoding no converter reads: the SDK drops a signal carrying it (and logs why), refuses an Update or a
query, and the job goes on. Raising instead would fail the workflow task, again on every retry: one
hand-typed signal would wedge the job for good.

Never imported by workflow code (the sandbox refuses to import `cryptography`): the data converter
(temporal/converter.py) and the API's codec endpoint use it.

The keys file (RAGLINE_CODEC_KEYS_FILE, TOML):

    current = "k-20250101"
    [keys]
    k-20250101 = "<base64 of 32 random bytes>"
    k-20240901 = "<older key, kept to read old histories>"
"""

from __future__ import annotations

import base64
import os
import secrets
import sys
import tempfile
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import structlog
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from temporalio.api.common.v1 import Payload
from temporalio.converter import PayloadCodec

from temporal.converter import UNENCRYPTED_ENCODING

ENCODING = b"binary/encrypted"
UNENCRYPTED = UNENCRYPTED_ENCODING.encode()  # what a payload that came in plain is marked (temporal/converter.py)
KEY_ID = "encryption-key-id"
NONCE_BYTES = 12

log = structlog.get_logger("ragline.codec")


class CodecError(ValueError):
    """A payload cannot be decoded (unknown key, tampered data, not encrypted) or the keys file is bad."""


@dataclass(frozen=True)
class CodecKeys:
    current: str
    keys: dict[str, bytes]


def new_key_id() -> str:
    return "k-" + datetime.now(timezone.utc).strftime("%Y%m%d%H%M%S")


def load_keys(path: Path) -> CodecKeys:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise CodecError(f"codec keys file {path} does not exist (`python -m temporal.codec create` makes one)") from None
    except tomllib.TOMLDecodeError as exc:
        raise CodecError(f"codec keys file {path} is not valid TOML: {exc}") from None
    keys: dict[str, bytes] = {}
    for key_id, value in (data.get("keys") or {}).items():
        try:
            raw = base64.b64decode(value, validate=True)
        except Exception:
            raise CodecError(f"{path}: key {key_id!r} is not base64") from None
        if len(raw) != 32:
            raise CodecError(f"{path}: key {key_id!r} has {len(raw)} bytes; AES-256 needs 32")
        keys[key_id] = raw
    current = data.get("current")
    if current not in keys:
        raise CodecError(f"{path}: current = {current!r} names no key in [keys]")
    return CodecKeys(current=current, keys=keys)


def _write(path: Path, keys: CodecKeys, *, exclusive: bool) -> None:
    lines = [f'current = "{keys.current}"', "", "[keys]"]
    lines += [f'{key_id} = "{base64.b64encode(raw).decode()}"' for key_id, raw in keys.keys.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".codec-keys-")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        if exclusive:
            os.link(tmp, path)  # fails if another process created it first: theirs wins
        else:
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_or_create(path: Path) -> CodecKeys:
    """The keys in `path`; a fresh file with one key when there is none (race-free between processes)."""
    if not path.exists():
        try:
            _write(path, _fresh(), exclusive=True)
        except FileExistsError:
            pass
    return load_keys(path)


def _fresh() -> CodecKeys:
    key_id = new_key_id()
    return CodecKeys(current=key_id, keys={key_id: secrets.token_bytes(32)})


def rotate(path: Path) -> str:
    """Add a new key and make it current; old keys stay so old histories remain readable."""
    keys = load_keys(path)
    key_id = new_key_id()
    while key_id in keys.keys:
        key_id += "x"
    _write(path, CodecKeys(current=key_id, keys={key_id: secrets.token_bytes(32), **keys.keys}), exclusive=False)
    return key_id


class KeysFile:
    """The keys file of a running process, read again when it has changed: a key that `rotate` added (in
    another process, or on a volume every pod mounts) is known without a restart. A process that started
    before the rotation reads payloads under the new key at once, and writes with it within CHECK_EVERY
    seconds (each write looks at the file that often)."""

    CHECK_EVERY = 5.0

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen = self._changed_at()
        self._checked = time.monotonic()
        self.keys = load_or_create(path)

    def _changed_at(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size  # a rotation writes a new file (os.replace): a new inode

    def refresh(self) -> bool:
        """Read the file again if it changed since; True when it did (and reads)."""
        self._checked = time.monotonic()
        changed = self._changed_at()
        if changed is None or changed == self._seen:
            return False
        self.keys, self._seen = load_keys(self.path), changed
        return True

    def refresh_due(self) -> bool:
        """As refresh, at most every CHECK_EVERY seconds, for writes: a file that does not read (an edit by
        hand under way) leaves the keys as they were, and is looked at again next time."""
        if time.monotonic() - self._checked < self.CHECK_EVERY:
            return False
        try:
            return self.refresh()
        except CodecError as exc:
            log.warning("codec keys file changed but does not read; the keys read before stay in use",
                        path=str(self.path), error=str(exc))
            return False


class EncryptionCodec(PayloadCodec):
    def __init__(self, keys: CodecKeys | KeysFile) -> None:
        self._file = keys if isinstance(keys, KeysFile) else None
        self._use(keys.keys if isinstance(keys, KeysFile) else keys)

    def _use(self, keys: CodecKeys) -> None:
        # The ciphers first: an encode on another thread (the blob sweep decodes off the event loop) meanwhile
        # finds the key it is told to use.
        self._ciphers = {key_id: AESGCM(raw) for key_id, raw in keys.keys.items()}
        self.current = keys.current

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        if self._file is not None and self._file.refresh_due():  # rotated: write with the new current key
            self._use(self._file.keys)
        cipher = self._ciphers[self.current]
        out = []
        for p in payloads:
            nonce = secrets.token_bytes(NONCE_BYTES)
            data = nonce + cipher.encrypt(nonce, p.SerializeToString(), self.current.encode())
            out.append(Payload(metadata={"encoding": ENCODING, KEY_ID: self.current.encode()}, data=data))
        return out

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return self.decode_sync(payloads)

    def decode_sync(self, payloads: Sequence[Payload]) -> list[Payload]:
        """As decode, for a thread of its own (the blob sweep reads every history off the event loop)."""
        out = []
        for p in payloads:
            if p.metadata.get("encoding") != ENCODING:
                out.append(Payload(metadata={"encoding": UNENCRYPTED,
                                             "unencrypted-encoding": p.metadata.get("encoding", b"")}, data=p.data))
                continue
            key_id = p.metadata.get(KEY_ID, b"").decode()
            cipher = self._ciphers.get(key_id)
            if cipher is None and self._file is not None and self._file.refresh():  # rotated since we read it
                self._use(self._file.keys)
                cipher = self._ciphers.get(key_id)
            if cipher is None:
                raise CodecError(f"payload encrypted with unknown key {key_id!r} (not in the codec keys file)")
            try:
                plain = cipher.decrypt(p.data[:NONCE_BYTES], p.data[NONCE_BYTES:], key_id.encode())
            except Exception:
                raise CodecError(f"payload does not decrypt with key {key_id!r} (tampered or wrong key)") from None
            original = Payload()
            original.ParseFromString(plain)
            out.append(original)
        return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    from ragline.settings import get_settings

    parser = argparse.ArgumentParser(prog="python -m temporal.codec", description="Payload encryption keys")
    parser.add_argument("command", choices=["create", "rotate", "show"])
    parser.add_argument("--file", type=Path, help="keys file (default: RAGLINE_CODEC_KEYS_FILE)")
    args = parser.parse_args(argv)
    path = args.file or get_settings().effective_codec_keys_file
    try:
        if args.command == "create":
            keys = load_or_create(path)
        elif args.command == "rotate":
            rotate(path)
            keys = load_keys(path)
        else:
            keys = load_keys(path)
    except CodecError as exc:  # most often: not the data folder the services use (RAGLINE_DATA_DIR)
        print(f"{exc}\n(the keys file is RAGLINE_CODEC_KEYS_FILE, or codec_keys.toml in RAGLINE_DATA_DIR; "
              "--file names another)", file=sys.stderr)
        return 2
    print(f"{path}: current key {keys.current}; {len(keys.keys)} key(s): {', '.join(keys.keys)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
