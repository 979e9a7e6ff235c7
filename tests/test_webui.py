"""Human input through the real Temporal Web UI: headless Chromium (Debian's /usr/bin/chromium, driven
by tests/webui/send_update.mjs with playwright-core) opens a workflow's page on this test's own dev
server, uses More Actions -> Send an Update, picks the Update name, pastes a JSON payload and submits.

The workflow here is a stand-in for a human-review step: it waits for an Update `approve` whose
validator accepts only decision "approve" or "reject". A bad payload must be refused in the dialog
with the validator's message (and leave the workflow waiting); a good one must complete it.

`make test` installs what this needs (Debian's chromium, `npm ci` in tests/webui). With
RAGLINE_SCREENSHOTS set, the PNGs of each stage are kept in tests/webui/screenshots/.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio import workflow
from temporalio.client import WorkflowExecutionStatus
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from temporal.devserver import temporal_binary

WEBUI_DIR = Path(__file__).parent / "webui"  # no resolve(): the workflow sandbox re-imports this module and forbids it
SEND_UPDATE = WEBUI_DIR / "send_update.mjs"
SCREENSHOTS = WEBUI_DIR / "screenshots"
CHROMIUM = "/usr/bin/chromium"


@dataclass
class Approval:
    reviewer: str
    decision: str  # "approve" | "reject"; a plain str so that the validator, not decoding, refuses others


@workflow.defn
class ApprovalWorkflow:
    """Waits for one valid `approve` Update and returns who decided what."""

    def __init__(self) -> None:
        self._approval: Approval | None = None

    @workflow.run
    async def run(self, subject: str) -> str:
        await workflow.wait_condition(lambda: self._approval is not None)
        assert self._approval is not None
        return f"{subject}: {self._approval.decision} by {self._approval.reviewer}"

    @workflow.update
    def approve(self, approval: Approval) -> str:
        self._approval = approval
        return f"recorded {approval.decision}"

    @approve.validator
    def _validate_approve(self, approval: Approval) -> None:
        if approval.decision not in ("approve", "reject"):
            raise ValueError(f"decision must be 'approve' or 'reject', got {approval.decision!r}")
        if not approval.reviewer.strip():
            raise ValueError("reviewer must not be empty")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _require_browser_tools() -> str:
    """Path of node; fails (never skips) when a piece that `make test` installs is missing."""
    node = shutil.which("node")
    missing = []
    if node is None:
        missing.append("node (Node.js) on PATH")
    if not os.access(CHROMIUM, os.X_OK):
        missing.append(f"{CHROMIUM} (Debian package chromium)")
    if not (WEBUI_DIR / "node_modules" / "playwright-core" / "package.json").is_file():
        missing.append(f"{WEBUI_DIR / 'node_modules'} (npm ci --prefix tests/webui)")
    if missing:
        pytest.fail("the Web UI browser test needs " + "; ".join(missing)
                    + ". `make test` installs them (apt-get install chromium, npm ci in tests/webui).",
                    pytrace=False)
    assert node is not None
    return node


async def _send_update(node: str, ui: str, workflow_id: str, name: str, payload: dict, *,
                       screenshots: Path | None = None, expect_error: bool = False) -> dict:
    argv = [node, str(SEND_UPDATE), "--ui", ui, "--namespace", "default", "--workflow-id", workflow_id,
            "--name", name, "--json", json.dumps(payload), "--timeout", "60"]
    if screenshots is not None:
        argv += ["--screenshots", str(screenshots)]
    if expect_error:
        argv.append("--expect-error")
    # Own process group, so that a hung run is ended together with its Chromium.
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=90)
    except asyncio.TimeoutError:
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        pytest.fail(f"send_update.mjs did not finish in 90 s: {' '.join(argv)}")
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    assert proc.returncode == 0, f"send_update.mjs exited {proc.returncode}:\n{stderr}\n{stdout}"
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one JSON line on stdout, got:\n{stdout}\nstderr:\n{stderr}"
    return json.loads(lines[0])


@pytest.mark.timeout(240)
async def test_update_sent_from_web_ui_dialog(tmp_path: Path) -> None:
    node = _require_browser_tools()
    started = time.monotonic()
    ui_port = _free_port()
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), ui=True, ui_port=ui_port,
        dev_server_extra_args=["--ui-disable-news-fetch"])
    ui = f"http://127.0.0.1:{ui_port}"
    keep = bool(os.environ.get("RAGLINE_SCREENSHOTS"))
    try:
        task_queue = f"webui-{uuid.uuid4().hex[:8]}"
        async with Worker(env.client, task_queue=task_queue, workflows=[ApprovalWorkflow]):
            handle = await env.client.start_workflow(
                ApprovalWorkflow.run, "invoice-42", id=f"webui-approval-{uuid.uuid4().hex[:8]}",
                task_queue=task_queue, execution_timeout=timedelta(minutes=5))
            # The dialog offers the Update names it learns from the workflow's metadata query, so
            # let the worker run the first workflow task before the page opens.
            await handle.query("__temporal_workflow_metadata")

            # (a) A decision the validator refuses: the dialog shows its message, nothing changes.
            if keep:
                shutil.rmtree(SCREENSHOTS, ignore_errors=True)
            bad = await _send_update(node, ui, handle.id, "approve",
                                     {"reviewer": "Ada Lovelace", "decision": "maybe"},
                                     screenshots=SCREENSHOTS / "rejected" if keep else None, expect_error=True)
            assert bad["ok"] is False, bad
            assert bad["error"] == "decision must be 'approve' or 'reject', got 'maybe'", bad
            assert bad["name_mode"] == "dropdown", bad  # the name came from the worker's metadata
            assert bad["expected"] is True
            desc = await handle.describe()
            assert desc.status == WorkflowExecutionStatus.RUNNING
            # A rejected Update leaves no trace in the history.
            history = await handle.fetch_history()
            assert not any(e.HasField("workflow_execution_update_accepted_event_attributes")
                           for e in history.events)

            # (b) A valid decision: accepted, and the workflow finishes with the reviewer's name.
            good = await _send_update(node, ui, handle.id, "approve",
                                      {"reviewer": "Ada Lovelace", "decision": "approve"},
                                      screenshots=SCREENSHOTS if keep else None)
            assert good["ok"] is True, good
            assert good["toast"] == "Update successful", good
            assert good["stage"] == "UPDATE_WORKFLOW_EXECUTION_LIFECYCLE_STAGE_COMPLETED", good
            result = await asyncio.wait_for(handle.result(), timeout=15)
            assert result == "invoice-42: approve by Ada Lovelace"
            if keep:
                shots = sorted(p.name for p in SCREENSHOTS.glob("*.png"))
                assert shots == ["01-workflow-page.png", "02-more-actions-menu.png",
                                 "03-dialog-filled.png", "04-after-submit.png"], shots
    finally:
        await env.shutdown()
    print(f"\nWeb UI update test took {time.monotonic() - started:.1f} s", file=sys.stderr)
