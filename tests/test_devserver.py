"""The dev-server launcher against the real `temporal` CLI: readiness, search attributes, stop, and
durability of the SQLite file across a restart, and how long the namespace keeps finished jobs."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import Client, WorkflowExecutionStatus

from ragline.settings import Settings
from temporal import search_attributes
from tests.conftest import free_server_port
from devtools.devserver import DevServer, dev_server_command, temporal_reachable


def _free_grpc_port() -> int:
    return free_server_port()


def _process_tree(pid: int | None) -> list[int]:
    """`pid` and its descendants, from /proc."""
    assert pid is not None
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(p := todo.pop())
        todo += children.get(p, [])
    return tree


def test_command_flags(tmp_path: Path) -> None:
    s = Settings(data_dir=tmp_path, temporal_address="127.0.0.1:7300", temporal_ui_port=8300,
                 temporal_namespace="ragline")
    argv = dev_server_command(s)
    assert argv[1:3] == ["server", "start-dev"]
    joined = " ".join(argv)
    for part in (f"--db-filename {tmp_path / 'temporal.db'}", "--ip 127.0.0.1", "--port 7300",
                 "--ui-port 8300", "--http-port 7310", "--metrics-port 7311", "--namespace ragline",
                 "--sqlite-pragma journal_mode=wal", "--sqlite-pragma synchronous=normal",
                 "--ui-disable-news-fetch", "--log-level warn", "--search-attribute RaglineStatus=Keyword",
                 "--dynamic-config-value matching.numTaskqueueReadPartitions=1"):
        assert part in joined
    assert "--namespace" not in dev_server_command(Settings(data_dir=tmp_path))
    assert "--env-file" not in argv
    assert f"--env-file {tmp_path / 'cli-env.yaml'}" in " ".join(dev_server_command(s, tmp_path / "cli-env.yaml"))


@pytest.mark.asyncio
async def test_dev_server_lifecycle_and_durability(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEMPORAL_ENV", "prod")  # a shell's CLI environment does not stop the dev server
    port = _free_grpc_port()
    settings = Settings(data_dir=tmp_path, temporal_address=f"127.0.0.1:{port}",
                        temporal_ui_port=port + 5)
    codec_endpoint = "http://127.0.0.1:9/codec/k/rgl_not-for-ps"
    server = DevServer(settings, ui_codec_endpoint=codec_endpoint)
    assert not await temporal_reachable(server.address)

    # First run: up, search attributes registered, start a workflow nobody will run.
    await server.start()
    try:
        assert server.running()
        assert await temporal_reachable(server.address)
        # The Web UI's codec endpoint (an operator key in its path) is in force, yet in no command line
        # any user of the machine can list, nor left in a file.
        async with httpx.AsyncClient() as http:
            ui = (await http.get(f"{server.ui_url}/api/v1/settings", timeout=10)).json()
        assert ui["Codec"]["Endpoint"] == codec_endpoint
        for pid in _process_tree(server.pid):
            assert b"rgl_not-for-ps" not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert not server.cli_env_path.exists()
        assert "rgl_not-for-ps" not in server.log_path.read_text()
        client = await Client.connect(server.address, namespace=settings.temporal_namespace)
        resp = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=settings.temporal_namespace))
        for key in search_attributes.ALL:
            assert key.name in resp.custom_attributes, key.name
            assert resp.custom_attributes[key.name] == key.indexed_value_type
        assert resp.custom_attributes["RaglineChunks"] == IndexedValueType.INDEXED_VALUE_TYPE_INT
        # Finished jobs stay readable for RAGLINE_TEMPORAL_RETENTION (30d), not the dev server's own 24h.
        assert await _retention_days(client, settings.temporal_namespace) == 30
        handle = await client.start_workflow("Nothing", id="persist-check", task_queue="nobody-polls")
        assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
    finally:
        await server.stop()
    assert not server.running()
    assert not await temporal_reachable(server.address)
    assert server.db_path.exists() and server.log_path.exists()

    # Second run on the same database file: the workflow is still there; a changed retention applies.
    settings = settings.model_copy(update={"temporal_retention": "90d"})
    async with DevServer(settings) as again:
        client = await Client.connect(again.address, namespace=settings.temporal_namespace)
        desc = await client.get_workflow_handle("persist-check").describe()
        assert desc.status == WorkflowExecutionStatus.RUNNING
        assert desc.workflow_type == "Nothing"
        assert await _retention_days(client, settings.temporal_namespace) == 90
        # Updating the retention left the search attributes registered.
        resp = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=settings.temporal_namespace))
        assert all(key.name in resp.custom_attributes for key in search_attributes.ALL)
    assert not await temporal_reachable(settings.temporal_address)


async def _retention_days(client: Client, namespace: str) -> float:
    described = await client.workflow_service.describe_namespace(DescribeNamespaceRequest(namespace=namespace))
    return described.config.workflow_execution_retention_ttl.ToTimedelta().total_seconds() / 86400


def test_two_of_the_dev_servers_own_ports_the_same_are_refused_by_name(tmp_path: Path) -> None:
    """The Web UI on the frontend's port + 10 (where its HTTP API goes): said up front with the settings to
    change, not as the server's bind error after it has started."""
    from devtools.devserver import DevServerError
    port = free_server_port()
    server = DevServer(Settings(data_dir=tmp_path, temporal_address=f"127.0.0.1:{port}", temporal_ui_port=port + 10))
    with pytest.raises(DevServerError, match="RAGLINE_TEMPORAL_UI_PORT"):
        server._check_ports()


def test_a_retention_under_a_day_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 1d"):
        Settings(data_dir=tmp_path, temporal_retention="12h")


def _supervised(tmp_path: Path, spec_source: str) -> tuple[subprocess.Popen, int]:
    """A process standing in for `make run`'s supervisor, which starts one child (`spec_source`: a
    ProcessSpec expression) and prints its pid; and that pid."""
    parent = subprocess.Popen([sys.executable, "-c", f"""
import asyncio, os, signal, sys
from pathlib import Path
from devtools.supervisor import Managed, ProcessSpec

async def main():
    child = Managed({spec_source}, Path({str(tmp_path)!r}), dict(os.environ))
    await child.start()
    print(child.proc.pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""], cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.PIPE, text=True)
    return parent, int(parent.stdout.readline())


def _ended(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while True:
        try:
            os.kill(pid, 0)
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":  # ended; init reaps it
                return True
        except (ProcessLookupError, OSError):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _kill_supervisor_then_expect_the_end_of(parent: subprocess.Popen, child: int) -> None:
    """SIGKILL the supervisor (as an OOM kill would): its child ends within 30 s on its own."""
    parent.kill()
    parent.wait()
    try:
        assert _ended(child, 30), f"process {child} outlived the supervisor that started it"
    finally:
        if not _ended(child, 0):
            os.kill(child, signal.SIGKILL)


def test_a_process_make_run_started_ends_when_make_run_is_killed(tmp_path: Path) -> None:
    """`make run`'s supervisor killed outright (SIGKILL, an OOM kill) takes its processes with it. Left
    behind, the worker failed every step it took on the dead supervisor's pipe (Broken pipe) and
    dead-lettered the jobs in flight, and the next `make run` found the ports taken."""
    parent, child = _supervised(tmp_path, "ProcessSpec(name='sleeper', argv=[sys.executable, '-c', "
                                          "'import time; time.sleep(120)'])")
    os.kill(child, 0)  # it runs
    _kill_supervisor_then_expect_the_end_of(parent, child)


def test_a_child_that_would_not_stop_on_sigterm_gets_sigkill_when_make_run_dies(tmp_path: Path) -> None:
    """The local model's server keeps nothing and finishes the generation in flight before it stops on
    SIGTERM (minutes on a busy machine, with nobody left to send the second signal): it gets SIGKILL."""
    stubborn = '"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"'
    parent, child = _supervised(tmp_path, f"ProcessSpec(name='stubborn', argv=[sys.executable, '-c', {stubborn}], "
                                          "parent_death_signal=signal.SIGKILL)")
    _kill_supervisor_then_expect_the_end_of(parent, child)
    from devtools.supervisor import llm_spec
    assert llm_spec(Settings(data_dir=tmp_path)).parent_death_signal == signal.SIGKILL


def test_the_worker_ends_when_make_run_is_killed_outright(tmp_path: Path, temporal_env) -> None:
    """The real worker, polling, its output piped to a supervisor that is SIGKILLed: it gets SIGTERM,
    stops and ends, although the lines it writes meanwhile go to a pipe nobody reads (a flush of them
    that raised skipped its exit without teardown, and a worker orphaned so could hang on,
    temporalio/sdk-python#300)."""
    env = {"RAGLINE_DATA_DIR": str(tmp_path), "RAGLINE_TASK_QUEUE": "ragline-orphan",
           "RAGLINE_TEMPORAL_ADDRESS": temporal_env.client.service_client.config.target_host,
           "RAGLINE_LLM_BASE_URL": "http://127.0.0.1:9/v1", "RAGLINE_WORKER_METRICS_PORT": "0"}
    parent, child = _supervised(tmp_path, f"ProcessSpec(name='worker', argv=[sys.executable, 'worker.py'], "
                                          f"env={env!r})")
    log = tmp_path / "worker.log"
    deadline = time.monotonic() + 60
    while "worker polling" not in (log.read_text() if log.exists() else ""):
        if time.monotonic() > deadline or _ended(child, 0):
            parent.kill()
            pytest.fail(f"the worker did not start polling: {log.read_text() if log.exists() else ''}")
        time.sleep(0.2)
    _kill_supervisor_then_expect_the_end_of(parent, child)


def test_a_worker_touches_its_alive_file_while_it_runs_and_not_while_it_hangs(tmp_path: Path, temporal_env) -> None:
    """The real worker (role workflows) touches RAGLINE_WORKER_ALIVE_FILE while it polls; frozen (SIGSTOP, as a
    hung event loop), it does not, so the file ages past what the liveness probe allows; thawed, it goes on."""
    alive = tmp_path / "alive"
    every = 0.3
    env = {**os.environ, "RAGLINE_DATA_DIR": str(tmp_path), "RAGLINE_TASK_QUEUE": f"ragline-alive-{os.getpid()}",
           "RAGLINE_TEMPORAL_ADDRESS": temporal_env.client.service_client.config.target_host,
           "RAGLINE_LLM_BASE_URL": "http://127.0.0.1:9/v1", "RAGLINE_WORKER_METRICS_PORT": "0",
           "RAGLINE_WORKER_ALIVE_FILE": str(alive), "RAGLINE_WORKER_ALIVE_EVERY": str(every)}
    worker = subprocess.Popen([sys.executable, "worker.py", "--role", "workflows"], env=env,
                              cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)

    def touched_after(moment: float, within: float) -> bool:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if alive.exists() and alive.stat().st_mtime > moment:
                return True
            time.sleep(0.05)
        return False

    try:
        assert touched_after(0, 60), "the worker never touched its alive file"
        assert touched_after(alive.stat().st_mtime, 5 * every), "touched once, then not again"
        worker.send_signal(signal.SIGSTOP)
        frozen_at = time.time()
        time.sleep(0.1)  # a touch on its way lands
        last = alive.stat().st_mtime
        assert not touched_after(last, 8 * every), "touched while frozen"
        assert time.time() - alive.stat().st_mtime > 7 * every > 0 and last <= frozen_at + 0.1
        worker.send_signal(signal.SIGCONT)
        assert touched_after(last, 60), "not touched again once thawed"
    finally:
        worker.send_signal(signal.SIGCONT)
        worker.terminate()
        worker.wait(timeout=30)


def test_one_stop_delivered_twice_at_once_stops_make_run_gracefully(tmp_path: Path) -> None:
    """`kill -TERM -- -<pgid>` reaches the supervisor twice (directly, and passed on by make): that is one
    stop, not the "again" that kills everything at once. A second signal a moment later still is."""
    from devtools.supervisor import Supervisor

    supervisor = Supervisor(Settings(data_dir=tmp_path), specs=[])
    now = [100.0]
    supervisor._clock = lambda: now[0]
    supervisor._on_signal(signal.SIGTERM)
    now[0] += 0.01
    supervisor._on_signal(signal.SIGTERM)
    assert supervisor.stop_requested.is_set() and not supervisor.forced
    now[0] += 2
    supervisor._on_signal(signal.SIGINT)
    assert supervisor.forced


async def test_make_run_refuses_a_running_server_whose_task_queue_another_stacks_worker_polls(
        tmp_path: Path, temporal_env) -> None:
    """A second `make run` (another checkout, another person's stack on the default ports) found the first one's
    dev server answering at RAGLINE_TEMPORAL_ADDRESS and joined it: each stack's worker took the other's tasks,
    and a chat turn of the first stuck for good on a payload encrypted with the second's key. A live worker of
    this machine serving another data folder on our task queues is named, and refused; one of our own data
    folder, one that has ended, and one of another machine are not."""
    import socket
    import uuid

    from temporalio import activity
    from temporalio.worker import Worker

    from devtools.supervisor import other_stack_worker, other_stacks_workers

    @activity.defn(name="noop")
    async def noop() -> None:
        return None

    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    queue = f"ragline-stacks-{uuid.uuid4().hex[:8]}"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "worker.py"],
                             env={**os.environ, "RAGLINE_DATA_DIR": str(theirs)})
    try:
        while b"worker.py" not in Path(f"/proc/{other.pid}/cmdline").read_bytes():  # Popen may return before exec
            time.sleep(0.01)
        host = socket.gethostname()
        identity = f"ragline-all@{host}:{other.pid}"
        assert other_stack_worker(identity, ours) == f"pid {other.pid}, data folder {theirs.resolve()}"
        assert other_stack_worker(identity, theirs) is None                    # a worker of this very stack
        assert other_stack_worker(f"ragline-all@elsewhere:{other.pid}", ours) is None
        assert other_stack_worker(f"ragline-all@{host}:{os.getpid()}", ours) is None  # not a worker.py
        assert other_stack_worker("12345@somebody", ours) is None

        target = temporal_env.client.service_client.config.target_host
        client = await Client.connect(target, identity=identity)
        async with Worker(client, task_queue=f"{queue}-llm", activities=[noop]):
            deadline = time.monotonic() + 30
            while not (found := await other_stacks_workers(temporal_env.client, queue, ours)):
                assert time.monotonic() < deadline, "the poller never showed"
                await asyncio.sleep(0.2)
            assert found == [f"pid {other.pid}, data folder {theirs.resolve()}"]
            assert await other_stacks_workers(temporal_env.client, queue, theirs) == []
            # make run refuses before any setup: the walkthrough's second run assembled the model, wrote a codec
            # key and showed an operator key once, then refused.
            from devtools.supervisor import ProcessSpec, StartupError, Supervisor

            prepared = []
            supervisor = Supervisor(Settings(data_dir=ours, temporal_address=target, task_queue=queue), specs=[
                ProcessSpec(name="llm", argv=["true"], preflight=lambda: prepared.append("llm") or None)])
            with pytest.raises(StartupError, match="already has workers of another Ragline"):
                await supervisor._startup()
            assert prepared == [] and [p for p in ours.rglob("*") if p.is_file()] == []  # no key made, none shown
    finally:
        other.kill()
        other.wait()
    # Ended: the server still lists its poller for a while, but nothing of it is left to take tasks.
    assert await other_stacks_workers(temporal_env.client, queue, ours) == []


async def test_make_run_names_every_port_taken_at_once(tmp_path: Path) -> None:
    """A second `make run` on the default ports finds them all taken: it named the first (the llm's) only, so
    moving ports took a run per port. Every preflight's problem is said, each on a line, before anything starts."""
    from devtools.supervisor import ProcessSpec, StartupError, Supervisor

    def taken(setting: str):
        return lambda: f"127.0.0.1:1 is already in use. Stop it or choose another port with {setting}=..."

    specs = [ProcessSpec(name="llm", argv=["true"], preflight=taken("RAGLINE_LLM_PORT")),
             ProcessSpec(name="worker", argv=["true"], preflight=lambda: None),
             ProcessSpec(name="api", argv=["true"], preflight=taken("RAGLINE_API_PORT"))]
    supervisor = Supervisor(Settings(data_dir=tmp_path), specs=specs)
    with pytest.raises(StartupError) as refused:
        await supervisor._startup()
    llm, api = str(refused.value).split("\nERROR: ")
    assert llm.startswith("llm: ") and "RAGLINE_LLM_PORT" in llm
    assert api.startswith("api: ") and "RAGLINE_API_PORT" in api
    assert not supervisor.managed  # nothing was started
