"""The worker's telemetry: its Runtime (SDK metrics served in the Prometheus format on
RAGLINE_WORKER_METRICS_PORT, Ragline's own beside them), a worker interceptor that measures every
activity attempt and ties its log lines to the job, and a poller for what only the server knows
(task-queue backlog, jobs waiting for a person or an operator)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import structlog
from temporalio import activity
from temporalio.api.enums.v1 import TaskQueueKind, TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client
from temporalio.exceptions import ApplicationError, CancelledError
from temporalio.runtime import (
    LogForwardingConfig, LoggingConfig, PrometheusConfig, Runtime, TelemetryConfig, TelemetryFilter,
)
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput, Interceptor

from ragline import logs, metrics, tracing
from ragline.settings import Settings
from temporal import queues
from temporal import search_attributes as sa

log = structlog.get_logger("ragline.telemetry")


def core_logging() -> LoggingConfig:
    """The SDK core's own lines (Rust: "workflow task duration exceeded…", poll errors) forwarded to Python
    logging, so that they are formatted, masked and JSON like every other line, not colour-coded text."""
    return LoggingConfig(filter=TelemetryFilter(core_level="WARN", other_level="WARN"),
                         forwarding=LogForwardingConfig(logger=logging.getLogger(logs.CORE_LOGGER)))


def worker_runtime(metrics_address: str | None = None, step_sla: dict[str, float] | None = None) -> Runtime:
    """The worker process's Runtime: the core's lines forwarded (`core_logging`), and with `metrics_address`
    its metrics (the SDK's and Ragline's) served at http://<metrics_address>/metrics (`step_sla`: RAGLINE_STEP_SLA,
    whose doubles become bounds of the step latency histogram). Build it once per
    process (the port binds at once), before any client that should use it."""
    return Runtime(telemetry=TelemetryConfig(logging=core_logging(), metrics=PrometheusConfig(
        bind_address=metrics_address, counters_total_suffix=True, durations_as_seconds=True,
        histogram_bucket_overrides=metrics.histogram_buckets(step_sla)) if metrics_address else None))


class StepTelemetry(Interceptor):
    """Per activity attempt: duration and outcome (ragline_step_duration_seconds, ragline_step_attempts_total),
    and log lines bound to job_id, step, attempt and the trace id. Runs inside the tracing interceptor's
    RunActivity span (client interceptors come first)."""

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _StepInbound(next)


class _StepInbound(ActivityInboundInterceptor):
    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        info = activity.info()
        meter = activity.metric_meter()
        bound = dict(job_id=info.workflow_id, step=info.activity_type, attempt=info.attempt)
        trace_id = tracing.current_trace_id()
        if trace_id:
            bound["trace_id"] = trace_id
        started = time.monotonic()
        outcome = "completed"
        with structlog.contextvars.bound_contextvars(**bound):
            try:
                return await super().execute_activity(input)
            except BaseException as exc:
                outcome = _outcome(exc)
                # Our taxonomy's class (InputError, TransientError…), not the ApplicationError carrying it.
                error_type = exc.type if isinstance(exc, ApplicationError) and exc.type else type(exc).__name__
                # A step stopped by its job's cancel is no failure of the step (ragline/logs.py says the same).
                say = log.info if outcome == "cancelled" else log.warning
                say("step attempt failed", outcome=outcome, error_type=error_type, error=str(exc)[:300])
                raise
            finally:
                metrics.step_attempt(meter, time.monotonic() - started, outcome, retry=info.attempt > 1)


def _outcome(exc: BaseException) -> str:
    if isinstance(exc, (asyncio.CancelledError, CancelledError)):
        return "cancelled"
    if isinstance(exc, ApplicationError) and exc.non_retryable:
        return "non_retryable_error"
    return "retryable_error"


def export_step_sla(runtime: Runtime, settings: Settings, steps: Iterable[str] | None = None) -> None:
    """The SLA (ragline_step_sla_seconds) of each step this worker runs (`steps`; None: every step): the
    latency alert compares a step's p95 with it, and takes the largest a worker exports, so a role exports
    only its own steps' (an override set on the llm role is not outvoted by another role's default)."""
    sla = runtime.metric_meter.create_gauge_float(
        metrics.STEP_SLA, "What one step should take; alerts fire at 2x its p95", "s")
    runs = None if steps is None else set(steps)
    for step, seconds in {**metrics.DEFAULT_STEP_SLA_SECONDS, **settings.step_sla}.items():
        if runs is None or step in runs:
            sla.set(float(seconds), {"activity_type": step})


def export_activity_slots(runtime: Runtime, slots: dict[str, int]) -> None:
    """The most activities this worker runs at once on each queue it polls (ragline_worker_activity_slots): a
    queue's capacity for the backlog alerts, the same whether its slots are fixed or follow CPU and memory (a
    resource-based tuner, which exports no free-slot count), and the sign that some worker polls it."""
    gauge = runtime.metric_meter.create_gauge(metrics.ACTIVITY_SLOTS, "Most activities one worker runs at once")
    for task_queue, most in slots.items():
        gauge.set(most, {"task_queue": task_queue})


class ServerStatsPoller:
    """Sets, every `interval` seconds, the gauges only the server can answer: each task queue's
    approximate backlog, and the jobs on this worker's queue waiting for a review or an operator."""

    def __init__(self, client: Client, settings: Settings, runtime: Runtime) -> None:
        self.client = client
        self.settings = settings
        meter = runtime.metric_meter
        self.backlog = meter.create_gauge(metrics.BACKLOG, "Tasks waiting on the task queue (server's approximate_backlog_count)")
        self.reviews = meter.create_gauge(metrics.REVIEWS_WAITING, "Jobs waiting for a human review")
        self.dead = meter.create_gauge(metrics.DEAD_LETTERED_WAITING, "Dead-lettered jobs waiting for an operator")
        self.errors = meter.create_counter(metrics.POLL_ERRORS, "Failed polls of the server's statistics")
        self.errors.add(0)  # exported from the start: an alert's increase() counts the first failure too

    @staticmethod
    def wanted(role: str) -> bool:
        """The statistics are the deployment's, the same whoever asks: the processes that run workflows read
        them (a deployment has a few), not every activity worker besides (a fleet of llm workers would each
        ask the server 7 times a poll, visibility counts included)."""
        return "main" in queues.ROLES[role]

    def queues(self) -> Iterable[str]:
        return [queues.queue_name(self.settings.task_queue, kind) for kind in queues.QUEUE_KINDS]

    async def poll_once(self) -> None:
        ns = self.settings.temporal_namespace
        timeout = timedelta(seconds=self.settings.temporal_rpc_timeout)
        main = self.settings.task_queue
        runs_workflows = {queues.queue_name(main, kind) for kind in queues.WORKFLOW_KINDS}
        for name in self.queues():
            types = [("activity", TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY)]
            if name in runs_workflows:  # searches run as workflows on the vector queue
                types.append(("workflow", TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW))
            for label, type_ in types:
                resp = await self.client.workflow_service.describe_task_queue(DescribeTaskQueueRequest(
                    namespace=ns, task_queue=TaskQueue(name=name, kind=TaskQueueKind.TASK_QUEUE_KIND_NORMAL),
                    task_queue_type=type_, report_stats=True), timeout=timeout)
                self.backlog.set(resp.stats.approximate_backlog_count, {"task_queue": name, "type": label})
        for gauge, status in ((self.reviews, "waiting_review"), (self.dead, "dead_lettered")):
            query = (f"{sa.JOB_STATUS.name} = '{status}' AND ExecutionStatus = 'Running' "
                     f"AND TaskQueue = '{main}'")
            count = await self.client.count_workflows(query, rpc_timeout=timeout)
            gauge.set(count.count, {"task_queue": main})

    async def run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the server is down or restarting: try again next time
                self.errors.add(1)
                # "operation was canceled": the worker is stopping, not a server in trouble.
                say = log.info if "cancel" in str(exc).lower() else log.warning
                say("server statistics poll failed", error=str(exc)[:200])
            await asyncio.sleep(self.settings.metrics_poll_interval)
