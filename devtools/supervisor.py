"""Run everything locally: `python -m devtools.supervisor` (what `make run` calls).

A small supervisor:
  * uses the Temporal server already answering at RAGLINE_TEMPORAL_ADDRESS (unless another stack's workers, of
    another data folder, poll its task queue: then it stops), or starts the dev server
    (SQLite file in the data folder, so a second run finds its workflows again);
  * starts the processes of `process_specs()` in order (today: the local llama.cpp server unless
    RAGLINE_LLM_BASE_URL is set, then the workers, then API), each in its own process group, waiting
    for each to be ready before starting the next. RAGLINE_WORKERS (e.g. "workflows:1,cpu:1,llm:2,vector:1")
    says how many worker processes of each role (`worker.py --role ROLE`); unset, one of role `all`;
  * never starts a dev server for a RAGLINE_TEMPORAL_ADDRESS that is not on this machine (a cluster,
    Temporal Cloud): it waits for that server instead;
  * prefixes their output with their name on stdout and keeps it in <data_dir>/logs/<name>.log;
  * restarts a process (or the dev server it started) that exits unexpectedly, with backoff 1, 2, 4 ... 30 s;
  * on Ctrl-C / SIGTERM / SIGHUP stops the processes in reverse order, then Temporal, and exits 0.
    A second Ctrl-C skips the grace period (SIGKILL).

Adding a process (e.g. a local LLM server the worker needs): add a ProcessSpec to `process_specs()`
before the worker; see the example in its docstring.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import os
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from devtools.localmodel import LocalModelError, ensure_model, get_model, llama_server_argv, model_file
from ragline.settings import Settings, get_settings
from devtools.devserver import DevServer, DevServerError, die_with_parent, port_in_use, tail, temporal_reachable

PROJECT_ROOT = Path(__file__).resolve().parents[1]

STOP_TIMEOUT = 10.0       # SIGTERM -> wait this long -> SIGKILL
BACKOFF_FIRST = 1.0       # restart delays: 1, 2, 4, ... seconds
BACKOFF_MAX = 30.0
STABLE_AFTER = 60.0       # a process that ran this long restarts after BACKOFF_FIRST again
WEBUI_CODEC_KEY = "webui-codec"  # name of the operator key the Web UI's codec endpoint carries

ReadyCheck = Callable[[], Awaitable[bool]]
Preflight = Callable[[], "str | None"]


# ---------------------------------------------------------------------------------------------
# Process specs
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ProcessSpec:
    """One supervised process.

    name:          short name: output prefix `[name]`, log file <data_dir>/logs/<name>.log.
    argv:          command line; run with cwd (default: project root) and our environment plus `env`.
    ready:         async check polled every 0.25 s until it returns True (exceptions count as "not yet").
                   None: the process counts as ready once it has stayed alive for `alive_for` seconds.
    alive_for:     see `ready`.
    ready_timeout: seconds to wait for readiness at startup before giving up.
    preflight:     run once (in a thread) before anything is started; returns an error message to
                   fail fast (e.g. "port in use"), or None. It may also prepare what the process needs
                   (the llm's preflight assembles and verifies its model file).
    stop_timeout:  seconds from SIGTERM to SIGKILL.
    parent_death_signal: what the process gets when the supervisor dies without stopping it (SIGKILL, an
                   OOM kill): SIGTERM to stop cleanly; SIGKILL for one that keeps nothing and may not stop on
                   SIGTERM alone (llama.cpp's server finishes the generation in flight, minutes on a busy
                   machine, with nobody left to send the second signal).
    """
    name: str
    argv: Sequence[str]
    ready: ReadyCheck | None = None
    alive_for: float = 2.0
    ready_timeout: float = 60.0
    preflight: Preflight | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path = PROJECT_ROOT
    stop_timeout: float = STOP_TIMEOUT
    parent_death_signal: int = signal.SIGTERM


def http_ready(url: str, *, require_ok: bool = False, timeout: float = 2.0) -> ReadyCheck:
    """Ready once `url` answers an HTTP GET: with any status, or only 2xx if require_ok
    (e.g. llama.cpp's /health answers 503 while the model loads)."""
    async def check() -> bool:
        import httpx

        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
            resp = await client.get(url)
        return resp.is_success or not require_ok
    return check


def port_free(host: str, port: int, setting: str) -> Preflight:
    """Preflight failing with a message naming `setting` if host:port is already taken."""
    def check() -> str | None:
        if port_in_use(host, port):
            return (f"{host}:{port} is already in use (another `make run`, or some other program?). "
                    f"Stop it or choose another port with {setting}=...")
        return None
    return check


def _connect_host(host: str) -> str:
    """Host to connect to for a server bound to `host` (wildcards -> loopback), URL-ready."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"[{host}]" if ":" in host else host


def api_base_url(settings: Settings) -> str:
    return f"http://{_connect_host(settings.api_host)}:{settings.api_port}"


def llm_preflight(settings: Settings) -> Preflight:
    """The local llama.cpp server's preflight: port free, llama-cpp-python installed, model file
    assembled from its chunk packages and verified (devtools.localmodel.ensure_model)."""
    port_check = port_free("127.0.0.1", settings.llm_port, "RAGLINE_LLM_PORT")

    def check() -> str | None:
        if problem := port_check():
            return problem
        try:
            get_model(settings.local_model)
        except LocalModelError as e:
            return str(e)
        if importlib.util.find_spec("llama_cpp") is None:
            return (f"llama-cpp-python is not installed in {sys.prefix}: run `make run` (it installs the "
                    f"extra 'local-llm'), or set RAGLINE_LLM_BASE_URL to an OpenAI-compatible server.")
        try:
            ensure_model(settings, log=lambda msg: say(msg, "llm"))
        except LocalModelError as e:
            return str(e)
        return None
    return check


def llm_spec(settings: Settings) -> ProcessSpec:
    """The local llama.cpp server (OpenAI-compatible, model alias "local") on 127.0.0.1:llm_port.
    Building the spec is cheap: the model file is assembled by its preflight."""
    port = settings.llm_port
    try:
        argv = llama_server_argv(settings, model_file(settings))
    except LocalModelError:  # unknown RAGLINE_LOCAL_MODEL: the preflight reports it, nothing starts
        argv = [sys.executable, "-m", "llama_cpp.server"]
    return ProcessSpec(
        name="llm",
        argv=argv,
        ready=http_ready(f"http://127.0.0.1:{port}/v1/models", require_ok=True),
        ready_timeout=300,  # model loading
        preflight=llm_preflight(settings),
        # It keeps nothing, and finishes a generation whose client (the worker, stopped before it) has
        # gone before it stops: seconds of a Ctrl-C for nothing.
        stop_timeout=3.0,
        parent_death_signal=signal.SIGKILL,
    )


PROMETHEUS_DIR = PROJECT_ROOT / "deploy" / "prometheus"


def worker_metrics_targets(settings: Settings) -> dict[str, str]:
    """host:port of each worker process's metrics, by process name (RAGLINE_WORKERS: one port each, from
    RAGLINE_WORKER_METRICS_PORT on); none when worker metrics are off."""
    if not settings.worker_metrics_port:
        return {}
    host = _connect_host(settings.worker_metrics_host)
    return {spec.name: f"{host}:{spec.env.get('RAGLINE_WORKER_METRICS_PORT', settings.worker_metrics_port)}"
            for spec in worker_specs(settings)}


def temporal_metrics_target(settings: Settings) -> str:
    """Where the dev server `make run` starts serves its own metrics: its port + 11."""
    return f"{_connect_host(settings.temporal_host)}:{settings.temporal_port + 11}"


def prometheus_config(settings: Settings, *, scrape_temporal: bool = True) -> str:
    """deploy/prometheus/prometheus.yml with its targets set to where this run's processes listen: every
    worker process of RAGLINE_WORKERS among them (a scrape of the first alone left the model's errors, the
    llm queue's slots and the other roles' steps out of every alert). `scrape_temporal=False` leaves out the
    Temporal server's job: one this run did not start may serve its metrics elsewhere, or not at all."""
    text = (PROMETHEUS_DIR / "prometheus.yml").read_text()
    api = f"{_connect_host(settings.api_host)}:{settings.api_port}"
    workers = ", ".join(f'"{target}"' for target in worker_metrics_targets(settings).values())
    for default, actual in (('"127.0.0.1:8000"', f'"{api}"'), ('"127.0.0.1:9464"', workers),
                            ('"127.0.0.1:7244"', f'"{temporal_metrics_target(settings)}"')):
        text = text.replace(default, actual)
    if not scrape_temporal:
        text = re.sub(r"(?ms)^  - job_name: temporal\n.*?(?=^  - job_name:|\Z)", "", text)
    return text


def prometheus_folder(settings: Settings) -> Path:
    return Path(settings.data_dir) / "prometheus"


def prometheus_spec(settings: Settings) -> ProcessSpec:
    """RAGLINE_PROMETHEUS=1: Debian's Prometheus on deploy/prometheus/ (the Makefile installs it then),
    its config and time series in <data_dir>/prometheus."""
    folder = prometheus_folder(settings)
    port_check = port_free("127.0.0.1", settings.prometheus_port, "RAGLINE_PROMETHEUS_PORT")

    def preflight() -> str | None:
        import shutil

        if shutil.which("prometheus") is None:
            return "prometheus is not installed: `RAGLINE_PROMETHEUS=1 make run` installs Debian's package"
        if problem := port_check():
            return problem
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "prometheus.yml").write_text(prometheus_config(settings))
        (folder / "rules.yml").write_text((PROMETHEUS_DIR / "rules.yml").read_text())
        return None

    return ProcessSpec(
        name="prometheus",
        argv=["prometheus", f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'tsdb'}",
              f"--web.listen-address=127.0.0.1:{settings.prometheus_port}"],
        ready=http_ready(f"http://127.0.0.1:{settings.prometheus_port}/-/ready", require_ok=True),
        preflight=preflight,
    )


def process_specs(settings: Settings) -> list[ProcessSpec]:
    """The managed processes, in start order (they are stopped in reverse order; Temporal is
    handled separately: started before all of them, stopped after all of them).

    Unless RAGLINE_LLM_BASE_URL is set, the local llama.cpp server (`llm_spec`) comes first and the
    worker and API get RAGLINE_LLM_BASE_URL pointing at it. A process that another one needs goes
    before it, e.g.

        ProcessSpec(
            name="llm",
            argv=llama_server_argv(settings, model_file(settings)),
            ready=http_ready(f"http://127.0.0.1:{port}/v1/models", require_ok=True),
            ready_timeout=300,   # model loading
            preflight=llm_preflight(settings),   # port free, model assembled and verified
        ),
    """
    host, port = settings.api_host, settings.api_port
    specs: list[ProcessSpec] = []
    llm_env: dict[str, str] = {}
    if not settings.llm_base_url:
        # No hosted model configured: serve the local one and point the worker and API at it.
        specs.append(llm_spec(settings))
        llm_env = {"RAGLINE_LLM_BASE_URL": settings.effective_llm_base_url}
        # The worker now sees a base URL: keep what the local server wants (1 call at a time, as it runs them; plan
        # steps held to the tools' schemas, which llama.cpp turns into a grammar).
        llm_env["RAGLINE_LLM_CONCURRENCY"] = str(settings.effective_llm_concurrency)
        llm_env["RAGLINE_LLM_TOOL_CALLS"] = settings.effective_llm_tool_calls
    if settings.prometheus:
        specs.append(prometheus_spec(settings))
    return specs + worker_specs(settings, llm_env) + [
        ProcessSpec(
            name="api",
            argv=[sys.executable, "-m", "uvicorn", "api.app:app", "--host", host, "--port", str(port)],
            ready=http_ready(f"{api_base_url(settings)}/healthz"),
            preflight=port_free(host, port, "RAGLINE_API_PORT"),
            env=llm_env,
        ),
    ]


def worker_specs(settings: Settings, env: Mapping[str, str] | None = None) -> list[ProcessSpec]:
    """The worker processes of RAGLINE_WORKERS: `worker.py --role ROLE`, as many of each role as asked.
    Unset: one process of role `all`, named "worker" as before. The vector role goes first: with the
    embedded store it is the one process that opens it."""
    workers = settings.worker_processes

    def metrics_port_free(port: int) -> Preflight | None:
        # Taken, the worker would serve no metrics and Prometheus would scrape whatever holds the port.
        return port_free(settings.worker_metrics_host, port, "RAGLINE_WORKER_METRICS_PORT") if port else None

    if workers == [("all", 1)]:
        return [ProcessSpec(name="worker", argv=[sys.executable, "worker.py"], alive_for=2.0, env=dict(env or {}),
                            preflight=metrics_port_free(settings.worker_metrics_port))]
    order = {"vector": 0, "all": 0, "workflows": 1, "cpu": 2, "llm": 3}
    specs = []
    for role, count in sorted(workers, key=lambda rc: order[rc[0]]):
        for i in range(1, count + 1):
            own = dict(env or {})
            port = settings.worker_metrics_port and settings.worker_metrics_port + len(specs)
            if port:  # one metrics port per process: the first, then the next ones
                own["RAGLINE_WORKER_METRICS_PORT"] = str(port)
            specs.append(ProcessSpec(name=f"worker-{role}-{i}" if count > 1 else f"worker-{role}",
                                     argv=[sys.executable, "worker.py", "--role", role], alive_for=2.0, env=own,
                                     preflight=metrics_port_free(port)))
    return specs


WORKER_IDENTITY = re.compile(r"ragline-[a-z]+@(?P<host>.+):(?P<pid>\d+)")  # worker.py's client identity
POLLER_FRESHNESS = 120  # seconds: a poller not seen for longer has gone (as /healthz counts them)


def other_stack_worker(identity: str, data_dir: Path) -> str | None:
    """Who a poller of our task queues is when it is a live Ragline worker of this machine that serves another
    data folder ("pid 123, data folder /x"); None for one of this data folder (a worker started by hand for
    this stack), one that has ended, one of another machine or one that is not a Ragline worker."""
    import socket

    m = WORKER_IDENTITY.fullmatch(identity)
    if m is None or m["host"] != socket.gethostname():
        return None
    proc = Path("/proc") / m["pid"]
    try:
        if b"worker.py" not in (proc / "cmdline").read_bytes():
            return None  # ended, and its pid taken by another program since
        environ = dict(item.split(b"=", 1) for item in (proc / "environ").read_bytes().split(b"\0") if b"=" in item)
        cwd = Path(os.readlink(proc / "cwd"))
    except FileNotFoundError:
        return None  # ended
    except OSError:
        return f"pid {m['pid']} (another user's)"
    theirs = (cwd / os.fsdecode(environ.get(b"RAGLINE_DATA_DIR", b"./data"))).expanduser().resolve()
    return None if theirs == data_dir.expanduser().resolve() else f"pid {m['pid']}, data folder {theirs}"


async def other_stacks_workers(client: Any, task_queue: str, data_dir: Path) -> list[str]:
    """`other_stack_worker` of every poller seen lately on the task queues of `task_queue`, each named once."""
    from datetime import datetime, timezone

    from temporalio.api.enums.v1 import TaskQueueType
    from temporalio.api.taskqueue.v1 import TaskQueue
    from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest

    from temporal import queues

    found: list[str] = []
    now = datetime.now(timezone.utc)
    for kind in queues.QUEUE_KINDS:
        for queue_type in (TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW, TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY):
            answer = await client.workflow_service.describe_task_queue(DescribeTaskQueueRequest(
                namespace=client.namespace, task_queue=TaskQueue(name=queues.queue_name(task_queue, kind)),
                task_queue_type=queue_type), timeout=timedelta(seconds=5))
            for poller in answer.pollers:
                seen = (now - poller.last_access_time.ToDatetime(tzinfo=timezone.utc)).total_seconds()
                if seen < POLLER_FRESHNESS and (other := other_stack_worker(poller.identity, data_dir)):
                    if other not in found:
                        found.append(other)
    return found


def temporal_is_local(address: str) -> bool:
    """`make run` may start a dev server only for an address on this machine."""
    host = address.rsplit(":", 1)[0].strip("[]").lower()
    return host in ("127.0.0.1", "localhost", "::1", "0.0.0.0", "") or host.startswith("127.")


def chat_model_description(settings: Settings) -> str:
    if settings.llm_base_url:
        return f"{settings.llm_model} at {settings.llm_base_url}"
    try:
        title = get_model(settings.local_model).title
    except LocalModelError:
        title = "?"
    return (f"{settings.local_model} ({title}), local llama.cpp server at "
            f"{settings.effective_llm_base_url}")


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------

def say(text: str, name: str = "run") -> None:
    out = "".join(f"[{name}] {line}\n" for line in (text.splitlines() or [""]))
    try:
        sys.stdout.write(out)
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        pass


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class StartupError(RuntimeError):
    pass


class Stopping(Exception):
    """Shutdown was requested while we were waiting for something."""


# ---------------------------------------------------------------------------------------------
# One managed child process
# ---------------------------------------------------------------------------------------------

class Managed:
    def __init__(self, spec: ProcessSpec, log_dir: Path, env: Mapping[str, str]) -> None:
        self.spec = spec
        self.log_path = log_dir / f"{spec.name}.log"
        self.env = dict(env)
        self.env.update(spec.env)
        self.proc: asyncio.subprocess.Process | None = None
        self.started_at = 0.0
        self.starts = 0
        self._log_offset = 0
        self._pump: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> None:
        """Spawn the process (no waiting for readiness)."""
        self.starts += 1
        try:
            log = open(self.log_path, "ab")
        except OSError as e:
            raise StartupError(f"cannot open {self.log_path}: {e}") from e
        self._log_offset = log.tell()
        log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} start #{self.starts}: "
                  f"{' '.join(self.spec.argv)}\n".encode())
        log.flush()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.spec.argv, cwd=str(self.spec.cwd), env=self.env,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                preexec_fn=functools.partial(die_with_parent, self.spec.parent_death_signal),
                start_new_session=True)  # own process group: Ctrl-C reaches only us; we stop in order
        except OSError as e:
            log.close()
            raise StartupError(f"cannot start {self.name} ({' '.join(self.spec.argv)}): {e}") from e
        self.started_at = time.monotonic()
        self._pump = asyncio.create_task(self._pump_output(self.proc, log), name=f"pump-{self.name}")

    async def _pump_output(self, proc: asyncio.subprocess.Process, log: Any) -> None:
        """Copy the child's output to our stdout (prefixed) and to its log file, line by line."""
        assert proc.stdout is not None
        pending = b""
        try:
            while True:
                chunk = await proc.stdout.read(65536)
                if not chunk:
                    break
                log.write(chunk)
                log.flush()
                pending += chunk
                *lines, pending = pending.split(b"\n")
                if lines:
                    say("\n".join(x.rstrip(b"\r").decode("utf-8", "replace") for x in lines), self.name)
            if pending:
                say(pending.rstrip(b"\r").decode("utf-8", "replace"), self.name)
        finally:
            log.close()

    async def wait_exit(self) -> int:
        assert self.proc is not None
        code = await self.proc.wait()
        if self._pump is not None:
            # all output written before we report the exit; shielded so that cancelling a waiter
            # never cancels the pump itself
            await asyncio.shield(self._pump)
        return code

    async def wait_ready(self) -> None:
        """Return when ready; StartupError if the process exits or is not ready within ready_timeout."""
        spec = self.spec
        exit_task = asyncio.ensure_future(self.wait_exit())
        ready_task = asyncio.ensure_future(self._poll_ready())
        try:
            done, _ = await asyncio.wait({exit_task, ready_task}, timeout=spec.ready_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready_task.cancel()
            exit_task.cancel()
        if exit_task in done:
            raise StartupError(
                f"{self.name} exited ({_describe_exit(exit_task.result())}) before it was ready. "
                f"End of {self.log_path}:\n{self.log_tail()}")
        if ready_task not in done:
            raise StartupError(f"{self.name} was not ready within {spec.ready_timeout:.0f} s. "
                               f"End of {self.log_path}:\n{self.log_tail()}")

    async def _poll_ready(self) -> None:
        if self.spec.ready is None:
            await asyncio.sleep(self.spec.alive_for)
            return
        while True:
            try:
                if await self.spec.ready():
                    return
            except Exception:  # noqa: BLE001 - not answering yet
                pass
            await asyncio.sleep(0.25)

    def log_tail(self, lines: int = 30) -> str:
        return tail(self.log_path, lines, self._log_offset)

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    async def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM the process group; SIGKILL it if still alive after `timeout` seconds."""
        if self.proc is None:
            return
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(self.proc.wait()), timeout)
            except asyncio.TimeoutError:
                say(f"{self.name} did not stop within {timeout:.0f} s: SIGKILL")
                self.signal(signal.SIGKILL)
                await self.proc.wait()
        if self._pump is not None:
            try:
                await asyncio.wait_for(self._pump, 5.0)  # a grandchild may still hold the pipe open
            except asyncio.TimeoutError:
                pass


# ---------------------------------------------------------------------------------------------
# The supervisor
# ---------------------------------------------------------------------------------------------

class Supervisor:
    def __init__(self, settings: Settings, specs: Sequence[ProcessSpec] | None = None) -> None:
        data_dir = Path(settings.data_dir).expanduser().resolve()
        # Children run in the project root: give them the same data folder as an absolute path.
        self.settings = settings.model_copy(update={"data_dir": data_dir})
        self.log_dir = data_dir / "logs"
        self.specs = list(specs) if specs is not None else process_specs(self.settings)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAGLINE_DATA_DIR": str(data_dir)}
        self.managed: list[Managed] = []
        self.devserver: DevServer | None = None
        self.stop_requested = asyncio.Event()
        self.forced = False
        self._stop_asked_at: float | None = None
        self._clock = time.monotonic
        self._tasks: list[asyncio.Task[Any]] = []

    # -- signals -----------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, self._on_signal, sig)

    # One stop can arrive twice at once: `kill -TERM -- -<pgid>` (a process manager stopping `make run`)
    # signals the supervisor and make, and make passes its SIGTERM on to the supervisor.
    SAME_STOP_WITHIN = 1.0  # seconds

    def _on_signal(self, sig: int) -> None:
        now = self._clock()
        if not self.stop_requested.is_set():
            say(f"{signal.Signals(sig).name} received: stopping (again to kill at once)")
            self._stop_asked_at = now
            self.stop_requested.set()
        elif self._stop_asked_at is not None and now - self._stop_asked_at < self.SAME_STOP_WITHIN:
            return  # the same stop, delivered twice
        elif not self.forced:
            say(f"{signal.Signals(sig).name} received again: killing everything now")
            self.forced = True
            for m in self.managed:
                m.signal(signal.SIGKILL)
            if self.devserver is not None and self.devserver.running():
                try:
                    os.killpg(self.devserver.pid, signal.SIGKILL)  # type: ignore[arg-type]
                except (ProcessLookupError, PermissionError):
                    pass

    async def _unless_stopped(self, aw: Awaitable[Any]) -> Any:
        """Await `aw`, but give up (cancelling it) and raise Stopping if shutdown is requested."""
        task = asyncio.ensure_future(aw)
        stop = asyncio.ensure_future(self.stop_requested.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if task.done():
            return task.result()
        task.cancel()
        try:
            await task
        except BaseException:  # noqa: BLE001 - cancelled, or failed while being cancelled
            pass
        raise Stopping

    # -- main --------------------------------------------------------------------------------
    async def run(self) -> int:
        self.install_signal_handlers()
        try:
            try:
                await self._startup()
            except Stopping:
                return 0
            except (StartupError, DevServerError) as e:
                say(f"ERROR: {e}")
                return 1
            self._banner()
            self._tasks = [asyncio.create_task(self._supervise(m), name=f"supervise-{m.name}")
                           for m in self.managed]
            if self.devserver is not None:
                self._tasks.append(asyncio.create_task(self._supervise_temporal(), name="supervise-temporal"))
            await self.stop_requested.wait()
            return 0
        finally:
            await self.shutdown()

    async def _startup(self) -> None:
        s = self.settings
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StartupError(f"cannot create the data folder {self.log_dir} ({e}); check RAGLINE_DATA_DIR") from e

        # Before any setup (a model assembled, keys written and shown): a run this one cannot join stops here.
        local_server_up = temporal_is_local(s.temporal_address) and await temporal_reachable(s.temporal_address,
                                                                                            timeout=2.0)
        if local_server_up:
            await self._unless_stopped(self._refuse_another_stacks_workers())
        problems = []
        for spec in self.specs:  # fail fast, before starting anything
            # in a thread: the llm's preflight may take seconds (assembling and hashing its model)
            problem = await self._unless_stopped(asyncio.to_thread(spec.preflight)) if spec.preflight else None
            if problem:
                problems.append(f"{spec.name}: {problem}")
        if problems:  # every one at once: ports taken by another `make run` are all taken, not the first alone
            raise StartupError("\nERROR: ".join(problems))

        self._prepare_security()
        if not temporal_is_local(s.temporal_address):
            say(f"Temporal: using the server at {s.temporal_address} (namespace {s.temporal_namespace!r}"
                f"{', TLS' if s.temporal_uses_tls else ''}{', API key' if s.temporal_api_key else ''}); "
                "no dev server is started for an address elsewhere")
            await self._unless_stopped(self._register_search_attributes())
        elif local_server_up:
            say(f"Temporal: using the server already answering at {s.temporal_address}")
            await self._unless_stopped(self._register_search_attributes())
        else:
            say(f"Temporal: starting the dev server at {s.temporal_address} "
                f"(database {s.data_dir / 'temporal.db'}, log {self.log_dir / 'temporal.log'})")
            self.devserver = DevServer(s, ui_codec_endpoint=self._ui_codec_endpoint())
            await self._unless_stopped(self.devserver.start())
            say(f"Temporal: ready (pid {self.devserver.pid})")
        if s.prometheus and self.devserver is None:
            await self._unless_stopped(self._scrape_temporal_if_it_answers())

        for spec in self.specs:
            if self.stop_requested.is_set():
                raise Stopping
            m = Managed(spec, self.log_dir, self.env)
            self.managed.append(m)
            say(f"starting {spec.name}: {' '.join(spec.argv)}")
            await m.start()
            await self._unless_stopped(m.wait_ready())
            say(f"{spec.name} is ready (pid {m.proc.pid})")  # type: ignore[union-attr]

    async def _scrape_temporal_if_it_answers(self) -> None:
        """A Temporal server this run did not start is scraped where a dev server serves its metrics (port + 11)
        only if something answers there; else its target would be down for ever, and RaglineTargetDown firing."""
        s = self.settings
        target = temporal_metrics_target(s)
        try:
            answers = await http_ready(f"http://{target}/metrics", require_ok=True)()
        except Exception:  # noqa: BLE001 - refused, timed out, not HTTP: nothing to scrape there
            answers = False
        if not answers:
            (prometheus_folder(s) / "prometheus.yml").write_text(prometheus_config(s, scrape_temporal=False))
            say(f"Prometheus: not scraping the Temporal server (no metrics at {target}; its own are where its "
                "operator set them)")

    def _prepare_security(self) -> None:
        """A fresh data folder gets its keys: the payload encryption key, and one API key for tenant
        `default` (printed once, in the banner)."""
        from ragline import keys as api_keys

        s = self.settings
        self.new_api_key: str | None = None
        if s.encrypt_payloads:
            from temporal.codec import load_or_create

            codec_keys = load_or_create(s.effective_codec_keys_file)
            say(f"Payload encryption: on (key {codec_keys.current} in {s.effective_codec_keys_file})")
        path = s.effective_api_keys_file
        if not [k for k in api_keys.load(path).keys if k.name != WEBUI_CODEC_KEY]:
            # Whoever runs `make run` runs the deployment: an operator key (a reviewer that may use /codec).
            self.new_api_key = api_keys.create(path, "default", "operator", "default")
            # Said now as well as in the banner: a start that fails later would leave it unseen, and the next
            # start, finding a key, makes none.
            say(f"API key for tenant default (operator), shown once: {self.new_api_key}")

    def _ui_codec_endpoint(self) -> str | None:
        """A codec key for the Web UI's codec endpoint, new at every start (the last one is removed): the UI
        hands it to every browser that opens it, so it may call the codec endpoint and nothing else.
        The dev server reads it from a file it alone may read, removed once it is up (never its
        command line, which any `ps` shows)."""
        from ragline import keys as api_keys

        s = self.settings
        if not s.encrypt_payloads:
            return None
        path = s.effective_api_keys_file
        api_keys.remove(path, WEBUI_CODEC_KEY)
        key = api_keys.create(path, "default", "codec", WEBUI_CODEC_KEY, requests_per_minute=100_000)
        return f"{api_base_url(s)}/codec/k/{key}"

    async def _refuse_another_stacks_workers(self) -> None:
        """A local server already answering may be another `make run`'s (another checkout, or another person's
        stack on this machine, on the default ports): its workers poll the same task queues. Joined, each
        stack's workers take the other's tasks, fail them on payloads encrypted with other keys (the job is
        stuck, its history holds the foreign payload) and search another vector store. Refused, with the way
        out, when a live worker of this machine with another data folder polls them."""
        from temporal.client import connect

        s = self.settings
        try:
            # Listing pollers reads no payload: no codec key is made for it (this run may go no further).
            plain = s.model_copy(update={"encrypt_payloads": False})
            client = await asyncio.wait_for(connect(plain, identity="ragline-run"), 10)
            others = await other_stacks_workers(client, s.task_queue, Path(s.data_dir))
        except Exception as e:  # noqa: BLE001 - the search-attribute registration next reports the server
            say(f"Temporal: could not list the workers polling {s.task_queue!r} ({e!r}); going on")
            return
        if others:
            raise StartupError(
                f"the Temporal server at {s.temporal_address} already has workers of another Ragline polling "
                f"task queue {s.task_queue!r} ({'; '.join(others)}): another `make run`? Sharing one server "
                "and task queue, each would take the other's jobs and fail them (payloads encrypted with other "
                "keys, another vector store). Stop it, or give this run a server of its own: "
                "RAGLINE_TEMPORAL_ADDRESS, with RAGLINE_TEMPORAL_UI_PORT, RAGLINE_API_PORT, RAGLINE_LLM_PORT "
                "and RAGLINE_WORKER_METRICS_PORT (README, Settings)")

    async def _register_search_attributes(self) -> None:
        from temporal.client import connect
        from temporal.search_attributes import ensure_registered

        s = self.settings
        try:
            client = await asyncio.wait_for(connect(s, identity="ragline-run"), 10)
            await asyncio.wait_for(ensure_registered(client, s.temporal_namespace), 10)
        except Exception as e:  # noqa: BLE001
            raise StartupError(
                f"could not register Ragline's search attributes on the Temporal server at "
                f"{s.temporal_address}, namespace {s.temporal_namespace!r} "
                f"(does the namespace exist? RAGLINE_TEMPORAL_NAMESPACE): {e!r}") from e
        say(f"Temporal: search attributes registered in namespace {s.temporal_namespace!r}")

    def _banner(self) -> None:
        s = self.settings
        if self.devserver is not None:
            ui = self.devserver.ui_url
        else:
            ui = f"not managed by us (using the existing server at {s.temporal_address}; see its own UI)"
        say("\n".join([
            "-" * 64,
            "Ragline is running.",
            f"  API docs:        {api_base_url(s)}/docs",
            *self._key_lines(),
            f"  Temporal Web UI: {ui}",
            f"  Metrics:         {api_base_url(s)}/metrics (API), "
            + (", ".join(f"http://{target}/metrics ({name})" for name, target in worker_metrics_targets(s).items())
               if s.worker_metrics_port else "worker metrics off (RAGLINE_WORKER_METRICS_PORT=0)"),
            f"  Prometheus:      " + (f"http://127.0.0.1:{s.prometheus_port}/classic/alerts" if s.prometheus
                                      else "off (RAGLINE_PROMETHEUS=1 starts it on deploy/prometheus/)"),
            f"  Chat model:      {chat_model_description(s)}",
            f"  Data folder:     {s.data_dir}   (logs in {self.log_dir})",
            "  Stop:            Ctrl-C",
            "-" * 64,
        ]))

    def _key_lines(self) -> list[str]:
        s = self.settings
        lines = []
        if getattr(self, "new_api_key", None):
            lines += [f"  API key:         {self.new_api_key}",
                      "                   (tenant default, operator; shown once: keep it. More, with this "
                      f"RAGLINE_DATA_DIR={s.data_dir}: .venv/bin/python -m ragline.keys create --tenant NAME "
                      "--role member)"]
        else:
            lines.append(f"  API keys:        {s.effective_api_keys_file} (.venv/bin/python -m ragline.keys create ...)")
        if s.encrypt_payloads:
            lines.append(f"  Codec endpoint:  {api_base_url(s)}/codec (operator key; the Web UI uses it)")
        return lines

    # -- supervision -------------------------------------------------------------------------
    async def _supervise(self, m: Managed) -> None:
        backoff = BACKOFF_FIRST
        while True:
            try:
                code = await self._unless_stopped(m.wait_exit())
            except Stopping:
                return
            ran = time.monotonic() - m.started_at
            if ran >= STABLE_AFTER:
                backoff = BACKOFF_FIRST
            say(f"{m.name} exited unexpectedly ({_describe_exit(code)}) after {ran:.1f} s; "
                f"restarting in {backoff:.0f} s (log: {m.log_path})")
            try:
                await self._unless_stopped(asyncio.sleep(backoff))
            except Stopping:
                return
            backoff = min(backoff * 2, BACKOFF_MAX)
            try:
                await m.start()
            except StartupError as e:
                say(f"ERROR: {e}")
                m.started_at = time.monotonic()
                continue  # proc is the old, exited one: wait_exit returns at once -> next backoff
            say(f"{m.name} restarted (pid {m.proc.pid})")  # type: ignore[union-attr]
            self._tasks.append(asyncio.create_task(self._report_ready(m)))

    async def _report_ready(self, m: Managed) -> None:
        try:
            await m.wait_ready()
        except StartupError as e:
            if not self.stop_requested.is_set():
                say(f"{m.name} after restart: {str(e).splitlines()[0]}")
            return
        say(f"{m.name} is ready again")

    async def _supervise_temporal(self) -> None:
        server = self.devserver
        assert server is not None
        backoff = BACKOFF_FIRST
        while True:
            started = time.monotonic()
            try:
                code = await self._unless_stopped(server.wait())
            except Stopping:
                return
            if time.monotonic() - started >= STABLE_AFTER:
                backoff = BACKOFF_FIRST
            say(f"Temporal dev server exited unexpectedly ({_describe_exit(code)}); restarting in "
                f"{backoff:.0f} s. End of {server.log_path}:\n{server.log_tail(6)}")
            while True:
                try:
                    await self._unless_stopped(asyncio.sleep(backoff))
                except Stopping:
                    return
                backoff = min(backoff * 2, BACKOFF_MAX)
                try:
                    await self._unless_stopped(server.start())
                except Stopping:
                    return
                except DevServerError as e:
                    say(f"Temporal restart failed: {e}\nretrying in {backoff:.0f} s")
                    continue
                say(f"Temporal dev server restarted (pid {server.pid})")
                break

    async def shutdown(self) -> None:
        """Stop in reverse start order, Temporal last. Safe to call whatever state we are in."""
        self.stop_requested.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for m in reversed(self.managed):
            if m.alive():
                say(f"stopping {m.name} (pid {m.proc.pid})")  # type: ignore[union-attr]
            await m.stop(0.5 if self.forced else m.spec.stop_timeout)
        if self.devserver is not None and self.devserver.running():
            say(f"stopping Temporal dev server (pid {self.devserver.pid})")
            if self.forced:
                self.devserver.stop_timeout = 0.5
            await self.devserver.stop()
        say("stopped")


async def amain(settings: Settings | None = None, specs: Sequence[ProcessSpec] | None = None) -> int:
    try:
        supervisor = Supervisor(settings or get_settings(), specs)
    except ValueError as e:  # e.g. a bad RAGLINE_WORKERS
        say(f"ERROR: {e}")
        return 1
    return await supervisor.run()


def main() -> None:
    try:
        code = asyncio.run(amain())
    except KeyboardInterrupt:  # a signal before the handlers were installed
        code = 0
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without interpreter teardown: the Temporal SDK's native threads can crash it at exit
    # (temporalio/sdk-python#300), which would turn a clean stop into exit code 139/134.
    os._exit(code)


if __name__ == "__main__":
    main()
