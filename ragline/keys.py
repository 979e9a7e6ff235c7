"""API keys and per-tenant limits: one TOML file (RAGLINE_API_KEYS_FILE, default <data>/api_keys.toml).

    [[keys]]
    tenant = "acme"                # [a-z0-9][a-z0-9-]{0,31}
    sha256 = "<hex sha256 of the key>"   # the key itself is never stored
    name = "ci"                    # optional, shown in the audit log
    role = "member"                # member | reviewer | operator | codec (a reviewer may also decide
                                   # reviews and operate dead-lettered jobs; an operator is a reviewer
                                   # that may also use the codec endpoint, which reads every tenant's
                                   # payloads; a codec key may use that endpoint and nothing else)
    requests_per_minute = 120      # optional; RAGLINE_RATE_LIMIT_PER_MINUTE otherwise

    [tenants.acme]                 # optional per-tenant limits
    max_running_jobs = 4           # RAGLINE_TENANT_MAX_RUNNING_JOBS (overrides it)
    max_documents = 5000           # RAGLINE_TENANT_MAX_DOCUMENTS (overrides it): documents held at once
    max_upload_mb = 10             # RAGLINE_MAX_UPLOAD_MB (at most it), per file; bounds an upload's body too
    max_pages = 100                # RAGLINE_MAX_PAGES (at most it)
    fairness_weight = 3            # this tenant's share of busy task queues against the others' (default 1)

`python -m ragline.keys create --tenant acme --role reviewer [--name ci] [--rpm 120]` adds a key and
prints it once. The file is re-read when it changes: a new key works without restarting the API.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import secrets
import sys
import threading
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from models.tenancy import TENANT_PATTERN

Role = Literal["member", "reviewer", "operator", "codec"]
KEY_PREFIX = "rgl_"


# Strict: a misspelt limit (`request_per_minute`) is refused with the line's name, not read as no limit at all.
_STRICT = ConfigDict(extra="forbid")


class KeyEntry(BaseModel):
    model_config = _STRICT
    tenant: str = Field(pattern=TENANT_PATTERN)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    name: str | None = None
    role: Role = "member"
    requests_per_minute: int | None = Field(None, ge=1)


class TenantLimits(BaseModel):
    model_config = _STRICT
    max_running_jobs: int | None = Field(None, ge=1)
    max_upload_mb: float | None = Field(None, gt=0)
    max_pages: int | None = Field(None, ge=1)
    # Documents it may hold at once, over all its collections (RAGLINE_TENANT_MAX_DOCUMENTS otherwise).
    max_documents: int | None = Field(None, ge=1)
    # How many of a busy queue's tasks go to this tenant for each one of a tenant with weight 1.
    fairness_weight: float | None = Field(None, gt=0, le=1000)


class KeysFile(BaseModel):
    model_config = _STRICT
    keys: list[KeyEntry] = []
    tenants: dict[str, TenantLimits] = {}


log = structlog.get_logger("ragline.keys")


class KeysFileError(ValueError):
    pass


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def load(path: Path) -> KeysFile:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return KeysFile()
    except tomllib.TOMLDecodeError as exc:
        raise KeysFileError(f"{path} is not valid TOML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:  # unreadable for now (permissions, a network mount)
        raise KeysFileError(f"{path} cannot be read: {exc}") from None
    try:
        return KeysFile.model_validate(data)
    except ValidationError as exc:
        raise KeysFileError(f"{path}: {exc}") from None


@dataclass
class KeyRing:
    """The keys file, re-read when its modification time changes."""
    path: Path
    _stamp: tuple[int, int] | None = None
    _loaded: bool = False
    _file: KeysFile = field(default_factory=KeysFile)
    _by_digest: dict[str, KeyEntry] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _refresh(self) -> None:
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
        except OSError:  # not there, or not readable for now
            stamp = None
        with self._lock:
            if self._loaded and stamp == self._stamp:
                return
            if self._loaded and (stamp is None or stamp[1] == 0):
                # Gone or empty after it read well: an edit under way (a copy over it truncates first, an editor
                # may move it away before it writes), not "no keys": every key and open stream would stop.
                self._stamp = stamp
                log.error("keys file missing or empty: the keys read before stay in force", path=str(self.path))
                return
            try:
                keys_file = load(self.path)
            except KeysFileError as exc:
                if not self._loaded:
                    raise
                # A slip while editing the file must not lock every key out: the keys read last stay
                # in force until the file reads again.
                self._stamp = stamp
                log.error("keys file not re-read: the keys read before stay in force", error=str(exc))
                return
            self._file = keys_file
            self._by_digest = {k.sha256: k for k in self._file.keys}
            self._stamp, self._loaded = stamp, True

    def read(self) -> None:
        """Read the file now (KeysFileError when it never read well): an API starts only on one that reads."""
        self._refresh()

    def find(self, key: str) -> KeyEntry | None:
        self._refresh()
        wanted = digest(key)
        for known, entry in self._by_digest.items():
            if hmac.compare_digest(known, wanted):
                return entry
        return None

    def by_digest(self, sha256: str) -> KeyEntry | None:
        """The entry of a key already found by `find` (its sha256), as the file says now: None once revoked."""
        self._refresh()
        return self._by_digest.get(sha256)

    def limits(self, tenant: str, *, refresh: bool = True) -> TenantLimits:
        """`refresh=False`: as of the last read (right after `find`, which re-read the file if it changed)."""
        if refresh:
            self._refresh()
        return self._file.tenants.get(tenant, TenantLimits())

    def __len__(self) -> int:
        self._refresh()
        return len(self._by_digest)


def create(path: Path, tenant: str, role: Role = "member", name: str | None = None,
           requests_per_minute: int | None = None) -> str:
    """Append a new key to the file and return it (the only time it is ever shown)."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    entry = KeyEntry(tenant=tenant, sha256=digest(key), name=name, role=role, requests_per_minute=requests_per_minute)
    lines = ["", "[[keys]]"] + [f"{k} = {json.dumps(v)}" for k, v in entry.model_dump(exclude_none=True).items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a") as f:
        f.write("\n".join(lines) + "\n")
    load(path)  # the file is still valid
    return key


def matching(path: Path, name: str | None = None, *, key_id: str | None = None) -> list[KeyEntry]:
    """The keys named `name`, or whose sha256 starts with `key_id` (as `list` and the audit log show it)."""
    prefix = (key_id or "").rstrip("…").lower()
    return [k for k in load(path).keys
            if (name is not None and k.name == name) or (prefix and k.sha256.startswith(prefix))]


def remove(path: Path, name: str | None = None, *, key_id: str | None = None) -> int:
    """Drop the keys `matching`: their `[[keys]]` tables go from the file, and everything else (tenants'
    limits, comments, how numbers are written) stays as it was. Returns how many."""
    gone = {k.sha256 for k in matching(path, name, key_id=key_id)}
    if not gone:
        return 0
    tables = _tables(path.read_text(encoding="utf-8"))
    kept = [t for t in tables if (tomllib.loads(t).get("keys") or [{}])[0].get("sha256") not in gone]
    # Never an empty file: a running API takes one for an edit under way and keeps the keys it read.
    text = "".join(kept) or "# every key was removed (python -m ragline.keys revoke): no request is let in\n"
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    load(tmp)  # still a valid keys file
    os.replace(tmp, path)
    return len(tables) - len(kept)


def _tables(text: str) -> list[str]:
    """The file's text cut into its tables, each from the comment lines right above its header to the next
    table's (whatever comes before the first table is a piece of its own): joined, the text as it was."""
    lines = text.splitlines(keepends=True)
    starts = []
    for i, line in enumerate(lines):
        if line.startswith("["):
            while i > 0 and lines[i - 1].lstrip().startswith("#"):
                i -= 1
            starts.append(i)
    bounds = [0, *starts, len(lines)]
    return ["".join(lines[a:b]) for a, b in zip(bounds, bounds[1:])]


def main(argv: list[str] | None = None) -> int:
    from ragline.settings import get_settings

    parser = argparse.ArgumentParser(prog="python -m ragline.keys", description="Ragline API keys")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("create", help="create a key and print it once")
    c.add_argument("--tenant", required=True)
    c.add_argument("--role", choices=["member", "reviewer", "operator", "codec"], default="member",
                   help="member (default): any job of the tenant; reviewer: also reviews and operator decisions; "
                        "operator: a reviewer that may also use the codec endpoint; codec: that endpoint only")
    c.add_argument("--name", help="shown in the audit log")
    c.add_argument("--rpm", type=int, help="requests per minute for this key")
    sub.add_parser("list", help="list keys (tenant, role, name, key id; never the keys)")
    r = sub.add_parser("revoke", help="remove keys: the API refuses them as soon as it re-reads the file")
    which = r.add_mutually_exclusive_group(required=True)
    which.add_argument("--name", help="every key with this name")
    which.add_argument("--id", dest="key_id", help="the key whose id (as `list` shows it) starts so")
    parser.add_argument("--file", type=Path, help="keys file (default: RAGLINE_API_KEYS_FILE, else "
                                                  "<RAGLINE_DATA_DIR>/api_keys.toml: use the API's settings)")
    args = parser.parse_args(argv)
    path = args.file or get_settings().effective_api_keys_file
    if args.command == "create":
        try:
            key = create(path, args.tenant, args.role, args.name, args.rpm)
        except ValidationError as exc:
            parser.error("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))
        except KeysFileError as exc:
            parser.error(str(exc))
        print(f"key for tenant {args.tenant} ({args.role}) added to {path}; it is shown only now:", file=sys.stderr)
        print(key)
        return 0
    if not path.exists():  # the wrong folder, most likely: say which file was looked for
        print(f"no keys file at {path}: run this with the API's RAGLINE_DATA_DIR (or RAGLINE_API_KEYS_FILE), "
              "or name the file with --file", file=sys.stderr)
        return 1
    if args.command == "revoke":
        if args.key_id is not None and len(args.key_id.rstrip("…")) < 6:
            parser.error("--id: give at least 6 characters of the key id")
        found = matching(path, args.name, key_id=args.key_id)
        if args.key_id is not None and len(found) > 1:  # an id names one key: say which ones it could be
            parser.error(f"--id {args.key_id} matches {len(found)} keys: " +
                         ", ".join(f"{k.sha256[:16]} ({k.tenant}, {k.name or '-'})" for k in found))
        removed = remove(path, args.name, key_id=args.key_id)
        print(f"{removed} key(s) removed from {path}", file=sys.stderr)
        return 0 if removed else 1
    print(f"keys in {path}:", file=sys.stderr)
    for k in load(path).keys:
        print(f"{k.tenant}\t{k.role}\t{k.name or '-'}\t{k.sha256[:12]}…")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
