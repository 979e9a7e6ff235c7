"""What an operator reads on the console: an expected input error (the job fails with its reason) or a
provider's transient failure is one line, a bug keeps its traceback; every line, the standard library's
too, carries the job and trace it was written for. Activities fail in a real worker, on the session's
Temporal dev server, so that the lines are the Temporal SDK's own; the API's 4xx answers log none."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import uuid
from datetime import timedelta

import httpx
import pytest
import structlog
from temporalio import activity, workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from api.app import create_app
from ragline import keys as api_keys
from ragline import logs
from ragline.errors import InputError, TransientError
from ragline.settings import Settings
from temporal.errors import translate_errors


@activity.defn
@translate_errors
async def extract_locked_pdf() -> None:
    raise InputError("encrypted: password required")


@activity.defn
@translate_errors
async def call_an_unreachable_model() -> None:
    raise TransientError("cannot reach the model endpoint")


@activity.defn
async def step_with_a_bug() -> None:
    raise KeyError("page_count")


@workflow.defn(sandboxed=False)
class OneStep:
    """Runs one activity, once; completes whatever it raised."""

    @workflow.run
    async def run(self, step: str) -> str:
        try:
            await workflow.execute_activity(step, start_to_close_timeout=timedelta(seconds=30),
                                            retry_policy=RetryPolicy(maximum_attempts=1))
        except ActivityError:
            return "failed"
        return "completed"


@pytest.fixture
def configured_logs():
    """Logging as the worker and the API configure it at start."""
    logs.configure()


async def _failure_lines(client, caplog, step) -> list[logging.LogRecord]:
    """The SDK's records of the failed attempt of `step`, run by a worker of this test's own."""
    queue, workflow_id = f"logging-{uuid.uuid4().hex[:8]}", f"logging-{step.__name__}-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=queue, workflows=[OneStep], activities=[step],
                      workflow_runner=UnsandboxedWorkflowRunner()):
        with caplog.at_level(logging.WARNING, logger=logs.SDK_ACTIVITY_LOGGER):
            assert await client.execute_workflow(OneStep.run, step.__name__, id=workflow_id,
                                                 task_queue=queue) == "failed"
    return [r for r in caplog.records if r.name == logs.SDK_ACTIVITY_LOGGER
            and getattr(r, "temporal_activity", {}).get("workflow_id") == workflow_id]


async def test_an_input_error_is_one_line_without_a_traceback(temporal_env, caplog, configured_logs):
    [line] = await _failure_lines(temporal_env.client, caplog, extract_locked_pdf)
    assert line.exc_info is None and "Traceback" not in caplog.text
    message = line.getMessage()
    assert "extract_locked_pdf" in message and "InputError: encrypted: password required" in message
    assert line.temporal_activity["workflow_id"] in message and "\n" not in message


async def test_a_bug_keeps_its_traceback(temporal_env, caplog, configured_logs):
    [line] = await _failure_lines(temporal_env.client, caplog, step_with_a_bug)
    assert line.exc_info is not None and "Traceback (most recent call last)" in caplog.text


async def test_a_transient_failure_is_one_line_that_says_it_is_retried(temporal_env, caplog, configured_logs):
    """During a model outage every attempt of every step fails: a traceback each would bury the log."""
    [line] = await _failure_lines(temporal_env.client, caplog, call_an_unreachable_model)
    assert line.exc_info is None and "Traceback" not in caplog.text
    message = line.getMessage()
    assert "call_an_unreachable_model" in message and "on attempt 1 (transient: retried while" in message
    # Written after the step's own context closed, it carries the step's fields from the SDK's record.
    assert (line.job_id, line.step, line.attempt) == (line.temporal_activity["workflow_id"],
                                                      "call_an_unreachable_model", 1)
    assert "cannot reach the model endpoint" in message and "\n" not in message


def test_a_step_stopped_by_its_jobs_cancel_is_one_line_of_information(configured_logs):
    """The SDK completes a step whose job was cancelled (its heartbeat finds the job gone) "as failed",
    with a warning and a traceback of its own frames; and its core warns that the server no longer knows
    the activity. Neither is a problem of the step: one line of information each."""
    sdk = logging.getLogger(logs.SDK_ACTIVITY_LOGGER)
    try:
        raise asyncio.CancelledError("Activity cancelled")
    except asyncio.CancelledError:
        record = sdk.makeRecord(sdk.name, logging.WARNING, __file__, 1, "Completing activity as failed", (),
                                sys.exc_info(), extra={"temporal_activity": {
                                    "activity_type": "agent_plan", "workflow_id": "acme.agent-1", "attempt": 1}})
    assert all(f.filter(record) for f in sdk.filters)
    assert (record.levelno, record.exc_info) == (logging.INFO, None)
    assert record.getMessage() == "activity agent_plan of job acme.agent-1 stopped: its job was cancelled or has ended"
    core = logging.getLogger(logs.CORE_LOGGER)
    line = core.makeRecord(core.name, logging.WARNING, __file__, 1, "Activity not found on completion. This may "
                           "happen if the activity has already been cancelled but completed anyway.", (), None)
    assert all(f.filter(line) for f in core.filters) and line.levelno == logging.INFO
    other = core.makeRecord(core.name, logging.WARNING, __file__, 1, "Workflow task duration exceeded", (), None)
    assert all(f.filter(other) for f in core.filters) and other.levelno == logging.WARNING


def test_standard_library_lines_carry_the_job_and_the_trace(capfd, configured_logs):
    """The HTTP client's, pypdf's or uvicorn's lines, written while a step of a job runs (or a request is
    served), carry that job's fields and the trace id, as Ragline's own lines do."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    capfd.readouterr()
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("step") as span, \
            structlog.contextvars.bound_contextvars(job_id="acme.doc-1", step="extract_text", attempt=2):
        logging.getLogger("httpx").info("HTTP Request: POST http://model/v1/chat/completions")
        logging.getLogger("uvicorn.access").info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:1", "POST", "/v1/chats",
                                                 "1.1", 202)
    trace_id = format(span.get_span_context().trace_id, "032x")
    captured = capfd.readouterr()
    lines = [line for line in captured.err.splitlines() if "acme.doc-1" in line]
    assert len(lines) == 2, lines
    for line in lines:
        assert "step=extract_text" in line and "attempt=2" in line and f"trace_id={trace_id}" in line, line


async def test_the_api_answers_4xx_without_a_traceback(tmp_path, caplog, capsys):
    settings = Settings(data_dir=tmp_path, temporal_address="127.0.0.1:1")  # no Temporal needed for these
    key = api_keys.create(settings.effective_api_keys_file, "acme", "member", "logging")
    app = create_app(settings)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://api") as http:
        caplog.set_level(logging.DEBUG)
        unauthenticated = await http.get("/v1/jobs")
        invalid = await http.post("/v1/agents", json={"goal": 5}, headers={"Authorization": f"Bearer {key}"})
    assert (unauthenticated.status_code, invalid.status_code) == (401, 422)
    assert not [r for r in caplog.records if r.exc_info]
    printed = capsys.readouterr()
    assert "Traceback" not in printed.out + printed.err


async def test_the_step_line_names_the_error_of_our_taxonomy(temporal_env, capfd, configured_logs):
    """The worker's own line per failed attempt (temporal/telemetry.py) says InputError, not the
    ApplicationError that carries it to Temporal."""
    from temporal.telemetry import StepTelemetry

    queue = f"logging-{uuid.uuid4().hex[:8]}"
    async with Worker(temporal_env.client, task_queue=queue, workflows=[OneStep], activities=[extract_locked_pdf],
                      workflow_runner=UnsandboxedWorkflowRunner(), interceptors=[StepTelemetry()]):
        assert await temporal_env.client.execute_workflow(OneStep.run, extract_locked_pdf.__name__, id=queue,
                                                          task_queue=queue) == "failed"
    [line] = [line for line in capfd.readouterr().err.splitlines() if "step attempt failed" in line and queue in line]
    assert "error_type=InputError" in line and "outcome=non_retryable_error" in line, line


def test_a_library_line_with_an_exception_keeps_its_traceback_masked_in_json(capfd):
    """RAGLINE_LOG_JSON with RAGLINE_REDACT_PII: a library's record of an exception (the SDK's failed
    attempt, uvicorn's failed request) still carries its traceback, as text a log pipeline can read,
    with personal data masked in it too; no frame's local variables are printed."""
    logs.configure(json=True, redact=True)
    try:
        password = "s3cret-pdf-password"  # a local of the failing frame
        raise ValueError(f"cannot reach ana@example.com ({len(password)})")
    except ValueError:
        capfd.readouterr()
        logging.getLogger(logs.SDK_ACTIVITY_LOGGER).warning("Completing activity as failed", exc_info=True)
    finally:
        logs.configure()
    [line] = [json.loads(x) for x in capfd.readouterr().err.splitlines() if "Completing activity" in x]
    assert line["level"] == "warning" and line["exception"].startswith("Traceback (most recent call last)")
    assert "ValueError: cannot reach [email]" in line["exception"], line
    assert "ana@example.com" not in json.dumps(line) and "s3cret-pdf-password" not in json.dumps(line)


def test_an_access_line_masks_personal_data_in_a_url_encoded_path():
    """uvicorn logs the path as sent, URL-encoded: an e-mail in it reads jane.doe%40example.com."""
    from ragline.redact import RedactingFilter

    for path in ("/v1/jobs/jane.doe%40example.com", "/v1/chats/call%20%2B1%20415%20555%200199"):
        record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                                   ("127.0.0.1:1", "GET", path, "1.1", 422), None)
        RedactingFilter().filter(record)
        message = record.getMessage()
        assert "jane.doe" not in message and "555" not in message, message  # (a phone keeps its last digits)
        assert message.endswith('HTTP/1.1" 422'), message
