"""Child processes of the benchmark: started in their own process groups, logged to files, always
stopped (SIGTERM to the group, SIGKILL after a grace period), also from atexit as a last resort."""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from devtools.devserver import port_in_use, tail

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = "127.0.0.1"

_live: list["Proc"] = []


def _kill_leftovers() -> None:
    for proc in list(_live):
        proc.kill()


atexit.register(_kill_leftovers)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def temporal_ports() -> tuple[int, int]:
    """(frontend port P, UI port) with P, P+10 (HTTP) and P+11 (metrics) all free."""
    for _ in range(200):
        port = free_port()
        if port + 11 < 65536 and not any(port_in_use(LOOPBACK, p) for p in (port, port + 10, port + 11)):
            ui = free_port()
            if ui not in (port, port + 10, port + 11):
                return port, ui
    raise RuntimeError("could not find free ports for the Temporal dev server")


_api_headers: dict[str, dict[str, str]] = {}


def register_api_key(base_url: str, key: str) -> None:
    """Requests that `client()` makes to `base_url` carry this API key."""
    _api_headers[base_url.rstrip("/")] = {"Authorization": f"Bearer {key}"}


def api_headers(base_url: str) -> dict[str, str]:
    """The headers with the API key registered for `base_url` (none if there is none)."""
    return dict(_api_headers.get(base_url.rstrip("/"), {}))


# uvicorn's idle keep-alive for the bench's servers, and the client's (seconds).
KEEP_ALIVE = ["--timeout-keep-alive", "600"]
CLIENT_KEEP_ALIVE = 2.0


def client(base_url: str, timeout: float | httpx.Timeout, connections: int | None = None) -> httpx.AsyncClient:
    """An HTTP client for one of the bench's servers: loopback only (no proxy from the environment), the
    API key registered for it if any, room for `connections` at once."""
    # The client drops an idle connection well before the server does (KEEP_ALIVE): a request never goes
    # out on a connection the server is closing at that moment.
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections,
                          keepalive_expiry=CLIENT_KEEP_ALIVE) if connections \
        else httpx.Limits(keepalive_expiry=CLIENT_KEEP_ALIVE)
    return httpx.AsyncClient(base_url=base_url, trust_env=False, timeout=timeout, limits=limits,
                             headers=_api_headers.get(base_url.rstrip("/"), {}))


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """Our environment without any RAGLINE_* of the caller's shell (the bench is self-contained),
    loopback exempt from proxies, unbuffered output, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAGLINE_")}
    no_proxy = ",".join(filter(None, [env.get("NO_PROXY", ""), "127.0.0.1", "localhost"]))
    env.update(NO_PROXY=no_proxy, no_proxy=no_proxy, PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


class Proc:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_dir / f"{name}.log"
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)
        _live.append(self)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        return tail(self.log_path, lines)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)  # its own session: the group id is its pid
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        if self.alive():
            self._signal_group(signal.SIGKILL)
            self.popen.wait()
        if self in _live:
            _live.remove(self)

    async def stop(self, grace: float = 10.0) -> int | None:
        if self.alive():
            self._signal_group(signal.SIGTERM)
            deadline = time.monotonic() + grace
            while self.alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        if self.alive():
            self._signal_group(signal.SIGKILL)
        else:
            self._signal_group(signal.SIGKILL)  # anything it left behind in its group
        code = self.popen.wait()
        if self in _live:
            _live.remove(self)
        return code

    async def wait_ready(self, check: Callable[[], Awaitable[bool]], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with code {self.popen.returncode} during startup. "
                                   f"End of {self.log_path}:\n{self.log_tail()}")
            try:
                if await check():
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready within {timeout:.0f} s. "
                                   f"End of {self.log_path}:\n{self.log_tail()}")
            await asyncio.sleep(0.25)


def http_ok(url: str, *, body_check: Callable[[httpx.Response], bool] | None = None) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        async with httpx.AsyncClient(timeout=3, trust_env=False) as client:
            r = await client.get(url)
        return r.status_code == 200 and (body_check is None or body_check(r))
    return check
