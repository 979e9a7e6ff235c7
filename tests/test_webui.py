"""Human review through the real Temporal Web UI: headless Chromium (Debian's /usr/bin/chromium, driven
by tests/webui/send_update.mjs with playwright-core) opens a waiting agent's page on this test's own
dev server, uses More Actions -> Send an Update, picks `review`, pastes the decision and submits.

Payloads are encrypted, as with `make run`: the dev server's Web UI is pointed at the test API's codec
endpoint (`--ui-codec-endpoint`, a reviewer key in its path), so the page shows the decoded input and
the typed decision is encrypted through `/encode` before the server records it.

A bad payload must be refused in the dialog (and leave the agent waiting); a good one must let the
agent go on and complete. `make test` installs what this needs (Debian's chromium, `npm ci` in
tests/webui). With RAGLINE_SCREENSHOTS set, the PNGs of each stage are kept in docs/webui/ (the
README shows them).
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
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from ragline import keys as api_keys
from temporal import search_attributes as sa
from devtools.devserver import temporal_binary
from tests.conftest import SERVER_STARTUP, running_stack
from tests.helpers import delegate_until, waiting_reviews

WEBUI_DIR = Path(__file__).parent / "webui"
SEND_UPDATE = WEBUI_DIR / "send_update.mjs"
SCREENSHOTS = Path(__file__).parent.parent / "docs" / "webui"
CHROMIUM = "/usr/bin/chromium"


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
                       screenshots: Path | None = None, expect_error: bool = False,
                       expect_text: str | None = None) -> dict:
    argv = [node, str(SEND_UPDATE), "--ui", ui, "--namespace", "default", "--workflow-id", workflow_id,
            "--name", name, "--json", json.dumps(payload), "--timeout", "60"]
    if expect_text:
        argv += ["--expect-text", expect_text]
    if screenshots is not None:
        argv += ["--screenshots", str(screenshots)]
    if expect_error:
        argv.append("--expect-error")
    # Own process group, so that a hung run is ended together with its Chromium.
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    except asyncio.TimeoutError:
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        pytest.fail(f"send_update.mjs did not finish in 120 s: {' '.join(argv)}")
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    assert proc.returncode == 0, f"send_update.mjs exited {proc.returncode}:\n{stderr}\n{stdout}"
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one JSON line on stdout, got:\n{stdout}\nstderr:\n{stderr}"
    return json.loads(lines[0])


@pytest.mark.timeout(300)
async def test_agent_review_approved_from_the_web_ui(scripted_llm, tmp_path: Path) -> None:
    node = _require_browser_tools()
    started = time.monotonic()
    ui_port, api_port = _free_port(), _free_port()
    # The Web UI's codec key: a reviewer key of the stack's keys file, made before the dev server starts.
    ui_key = api_keys.create(tmp_path / "api_keys.toml", "acme", "codec", "webui-codec")
    codec_endpoint = f"http://127.0.0.1:{api_port}/codec/k/{ui_key}"
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), ui=True, ui_port=ui_port, search_attributes=list(sa.ALL),
        dev_server_startup_timeout=SERVER_STARTUP,
        dev_server_extra_args=["--ui-disable-news-fetch", "--ui-codec-endpoint", codec_endpoint])
    ui = f"http://127.0.0.1:{ui_port}"
    keep = bool(os.environ.get("RAGLINE_SCREENSHOTS"))
    address = env.client.service_client.config.target_host
    llm = scripted_llm.scope()  # this test's agents' plans carry its token
    llm.script_fn("agent", delegate_until(leaf_depth=1, token=llm.token))
    try:
        async with running_stack(address, scripted_llm, tmp_path, task_queue="ragline-webui", api_port=api_port,
                                 temporal_ui_port=ui_port) as stack:
            assert stack.settings.encrypt_payloads
            r = await stack.http.post("/v1/agents", json={"goal": f"Chart the northern cape {llm.token}",
                                                          "max_depth": 0})
            job_id = r.json()["job_id"]
            [review] = await waiting_reviews(stack, job_id)
            assert review["job_id"] == job_id and review["reason"] == "depth"

            # (a) A decision that is not one of approve/reject/revise: refused in the dialog.
            # The page shows the agent's input decoded through the codec endpoint (it is ciphertext on the server).
            bad = await _send_update(node, ui, job_id, "review", {"decision": "maybe", "reviewer": "Ada"},
                                     screenshots=SCREENSHOTS / "rejected" if keep else None, expect_error=True,
                                     expect_text="Chart the northern cape")
            assert bad["text_seen"] is True, bad
            assert bad["ok"] is False, bad
            assert "decision" in bad["error"], bad
            assert bad["name_mode"] == "dropdown", bad  # the name came from the worker's metadata
            assert (await stack.http.get(f"/v1/jobs/{job_id}")).json()["status"] == "waiting_review"

            # (b) Approval with one more level: the agent delegates and completes.
            payload = {"decision": "approve", "reviewer": "Ada Lovelace", "comment": "one level is fine",
                       "extra_depth": 1}
            good = await _send_update(node, ui, job_id, "review", payload,
                                      screenshots=SCREENSHOTS if keep else None)
            assert good["ok"] is True, good
            assert good["toast"] == "Update successful", good
            job = await stack.wait_done(job_id, timeout=60)
            assert job["status"] == "completed", job
            assert job["result"]["tree"]["children"][0]["answer"] == "answer from depth 1"
            [decision] = job["result"]["decisions"]
            assert decision["reviewer"] == "Ada Lovelace" and decision["decision"] == "approve"
            # The decision the UI sent was encrypted by the codec endpoint: the server holds no plain text.
            history = await env.client.get_workflow_handle(job_id).fetch_history()
            updates = [e.workflow_execution_update_accepted_event_attributes.accepted_request.input.args.payloads
                       for e in history.events if e.HasField("workflow_execution_update_accepted_event_attributes")]
            [accepted_args] = updates  # the bad one was refused by the validator, never recorded
            assert all(p.metadata["encoding"] == b"binary/encrypted" and b"Ada Lovelace" not in p.data
                       for p in accepted_args), accepted_args
            start_input = history.events[0].workflow_execution_started_event_attributes.input.payloads
            assert all(p.metadata["encoding"] == b"binary/encrypted" for p in start_input)
            assert not any(b"northern cape" in p.data for p in start_input)
    finally:
        llm.close()
        await env.shutdown()
    print(f"\nWeb UI review test took {time.monotonic() - started:.1f} s", file=sys.stderr)
