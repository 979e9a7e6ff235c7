"""Ragline's own metrics, named `ragline_*` with their unit in the name.

Two homes, one per process kind:

* The worker records through the Temporal SDK's metric meters (`workflow.metric_meter()` in workflow
  code: skipped on replay, so a replayed history never counts twice; `activity.metric_meter()` in
  activities; the Runtime's meter elsewhere). They are served with the SDK's own metrics on the
  worker's Prometheus port (RAGLINE_WORKER_METRICS_PORT), with the labels the SDK adds (`namespace`,
  `task_queue`, `workflow_type` / `activity_type`). Counters get `_total` appended by the exporter.
* The API records with `prometheus-client` (api/observability.py) and serves `GET /metrics`.

Labels stay low-cardinality: kinds, statuses, activity types, models, error types, queues. Never a job
id, document id, session or collection, unless RAGLINE_METRICS_COLLECTION_LABEL allows collections.
"""

from __future__ import annotations

from temporalio import activity
from temporalio.common import MetricMeter

# -- names (the dashboard and the alert rules use these; tests check each exists in a scrape) --------
JOBS = "ragline_jobs"                                   # counter -> ragline_jobs_total{kind,status}
STEP_DURATION = "ragline_step_duration_seconds"         # histogram {activity_type,outcome}
STEP_ATTEMPTS = "ragline_step_attempts"                 # counter -> _total {activity_type,outcome,retry}
STEP_SLA = "ragline_step_sla_seconds"                   # gauge {activity_type}
MODEL_CALLS = "ragline_model_calls"                     # counter -> _total {model,step}
MODEL_ERRORS = "ragline_model_errors"                   # counter -> _total {model,step,error_type}
MODEL_TOKENS = "ragline_model_tokens"                   # counter -> _total {model,step,kind=prompt|completion}
MODEL_DURATION = "ragline_model_call_duration_seconds"  # histogram {model,step}
EMBEDDED_PASSAGES = "ragline_embedded_passages"         # counter -> _total {model}
EMBEDDING_DURATION = "ragline_embedding_duration_seconds"  # histogram {model}
PAGES = "ragline_ingested_pages"                        # counter -> _total
CHUNKS = "ragline_ingested_chunks"                      # counter -> _total
REVIEWS_WAITING = "ragline_reviews_waiting"             # gauge {task_queue}
DEAD_LETTERED_WAITING = "ragline_dead_lettered_jobs"    # gauge {task_queue}
BACKLOG = "ragline_task_queue_backlog"                  # gauge {task_queue,type=workflow|activity}
ACTIVITY_SLOTS = "ragline_worker_activity_slots"        # gauge {task_queue}: one worker's most at once
POLL_ERRORS = "ragline_telemetry_poll_errors"           # counter -> _total
ANSWER_CACHE_LOOKUPS = "ragline_answer_cache_lookups"   # counter -> _total {result=hit|miss}

# Bucket bounds (seconds) for the histograms above: the SDK's defaults are in milliseconds.
# Twice each default step SLA below (4, 10, 20, 60, 120) is a bound: the latency alert (p95 over twice the SLA)
# then decides at a bound. Inside a bucket histogram_quantile guesses, near the bucket's top: a p95 of 2.6 s
# in a 2.5-5 bucket read 4.9 s, "over twice" a 2 s SLA.
DURATION_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 4, 5, 10, 20, 30, 60, 120, 300, 600]
# RAGLINE_STEP_SLA must say less: twice it is the highest bound, which a p95 past every bound reads as.
MAX_STEP_SLA_SECONDS = DURATION_BUCKETS[-1] / 2


def histogram_buckets(step_sla: dict[str, float] | None = None) -> dict[str, list[float]]:
    """The worker's latency histograms' bounds, with twice each overridden SLA (RAGLINE_STEP_SLA) among them."""
    steps = sorted({*DURATION_BUCKETS, *(2 * seconds for seconds in (step_sla or {}).values())})
    return {STEP_DURATION: steps, MODEL_DURATION: DURATION_BUCKETS, EMBEDDING_DURATION: DURATION_BUCKETS}

# What each step should take (seconds) before an operator cares: the p95 alert fires at twice this.
# Override any with RAGLINE_STEP_SLA='{"generate_answer": 90}'. Steps that wait by design (await_*) have none.
DEFAULT_STEP_SLA_SECONDS: dict[str, float] = {
    "extract_text": 60, "chunk_text": 10, "embed_chunks": 30, "index_chunks": 10, "prune_stale_chunks": 10,
    "remove_document_chunks": 10, "confirm_removal": 2, "forget_document": 10,
    "search_chunks": 2, "retrieve_context": 2, "summarize_context": 30, "extract_entities": 30,
    "generate_answer": 60, "agent_plan": 30, "search_documents": 5,
}

def _meter() -> MetricMeter:
    """The activity's meter inside an activity (labels: activity_type, task_queue), else a no-op."""
    return activity.metric_meter() if activity.in_activity() else MetricMeter.noop


def job_finished(meter: MetricMeter, kind: str, status: str) -> None:
    meter.create_counter(JOBS, "Jobs by kind and final status (dead_lettered: when parked)").add(
        1, {"kind": kind, "status": status})


def step_attempt(meter: MetricMeter, seconds: float, outcome: str, retry: bool) -> None:
    labels = {"outcome": outcome}
    meter.create_histogram_float(STEP_DURATION, "Duration of one activity attempt", "s").record(seconds, labels)
    meter.create_counter(STEP_ATTEMPTS, "Activity attempts by outcome; retry=true for attempts after the first").add(
        1, {**labels, "retry": "true" if retry else "false"})


def model_call(step: str, model: str, seconds: float, *, prompt_tokens: int = 0, completion_tokens: int = 0,
               error_type: str | None = None) -> None:
    """One call to the chat model (ragline/llm.py), from inside the activity that made it."""
    meter = _meter()
    labels = {"model": model, "step": step}
    meter.create_counter(MODEL_CALLS, "Model calls").add(1, labels)
    meter.create_histogram_float(MODEL_DURATION, "Model call duration", "s").record(seconds, labels)
    if error_type:
        meter.create_counter(MODEL_ERRORS, "Model call errors by error type").add(1, {**labels, "error_type": error_type})
    tokens = meter.create_counter(MODEL_TOKENS, "Model tokens by kind (prompt, completion)")
    if prompt_tokens:
        tokens.add(prompt_tokens, {**labels, "kind": "prompt"})
    if completion_tokens:
        tokens.add(completion_tokens, {**labels, "kind": "completion"})


def passages_embedded(model: str, count: int, seconds: float) -> None:
    """rate(ragline_embedded_passages_total) is passages embedded per second."""
    meter = _meter()
    meter.create_counter(EMBEDDED_PASSAGES, "Passages embedded").add(count, {"model": model})
    meter.create_histogram_float(EMBEDDING_DURATION, "Duration of one embedding batch", "s").record(
        seconds, {"model": model})


def document_ingested(meter: MetricMeter, pages: int, chunks: int, collection: str | None = None) -> None:
    labels = {"collection": collection} if collection else {}
    meter.create_counter(PAGES, "Pages of documents indexed").add(pages, labels)
    meter.create_counter(CHUNKS, "Chunks of documents indexed").add(chunks, labels)


def answer_cache_lookup(hit: bool) -> None:
    _meter().create_counter(ANSWER_CACHE_LOOKUPS, "Answer cache lookups by result").add(
        1, {"result": "hit" if hit else "miss"})
