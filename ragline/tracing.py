"""OpenTelemetry tracing: one trace per request, from the HTTP request through the workflows and every
activity attempt to the model call.

`configure()` installs the process's tracer provider once:
  * OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) set: spans are recorded and
    exported over OTLP/HTTP in batches (the standard OTEL_* variables apply: headers, service name...);
  * unset: nothing is recorded or exported (sampler always-off), but every request still gets a trace
    id that rides along (headers, CloudEvents `traceparent`, log lines), so correlation is free;
  * tests pass an exporter (in-memory): every span is recorded and handed to it at once.
Either way a span leaves without the text of a failure it recorded (`_FailureTextsOut`): a failure's
message may hold what Ragline encrypts everywhere else (a reviewer's comment, an operator's discard reason).

Temporal carries the context in its `_tracer-data` header (temporalio.contrib.opentelemetry, on the
client only: workers built from that client inherit it); httpx is instrumented, so the `openai`
client's calls are spans too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.propagators.textmap import CarrierT, Getter, default_getter
from opentelemetry.trace import Status
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_configured = False
_propagator = TraceContextTextMapPropagator()
TEMPORAL_HEADER = "_tracer-data"


def exporting() -> bool:
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def configure(service_name: str = "ragline", exporter=None) -> None:
    """Install the tracer provider and instrument httpx; idempotent (the first call wins)."""
    global _configured
    if _configured:
        return
    _configured = True
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    if exporter is not None:
        provider = TracerProvider(resource=resource, sampler=ALWAYS_ON)
        provider.add_span_processor(SimpleSpanProcessor(_FailureTextsOut(exporter)))
    elif exporting():
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider = TracerProvider(resource=resource)  # sampler from OTEL_TRACES_SAMPLER, default parent-based on
        provider.add_span_processor(BatchSpanProcessor(_FailureTextsOut(OTLPSpanExporter())))
    else:
        provider = TracerProvider(resource=resource, sampler=ALWAYS_OFF)
    trace.set_tracer_provider(provider)
    propagate.set_global_textmap(TraceParentOnly())
    HTTPXClientInstrumentor().instrument()


# An exception event's free text; its `exception.type` stays.
_FAILURE_TEXTS = frozenset({"exception.message", "exception.stacktrace"})


def _failure_type(description: str | None) -> str | None:
    """A span status's description ("AnswerRejected: answer rejected by ed: <comment>") cut to its type."""
    head, colon, _ = (description or "").partition(":")
    return head if colon and head.replace(".", "").isidentifier() else None


class _Scrubbed(ReadableSpan):
    """A span's copy that keeps the counts of what its limits dropped (OTLP exports them; a copy counts 0)."""

    def __init__(self, span: ReadableSpan, events: list[Event], status: Status) -> None:
        super().__init__(name=span.name, context=span.context, parent=span.parent, resource=span.resource,
                         attributes=span.attributes, events=events, links=span.links, kind=span.kind, status=status,
                         start_time=span.start_time, end_time=span.end_time,
                         instrumentation_scope=span.instrumentation_scope)
        self._dropped = (span.dropped_events, span.dropped_links)

    @property
    def dropped_events(self) -> int:
        return self._dropped[0]

    @property
    def dropped_links(self) -> int:
        return self._dropped[1]


def _without_failure_texts(span: ReadableSpan) -> ReadableSpan:
    def scrubbed(event: Event) -> Event:
        kept = BoundedAttributes(maxlen=None, attributes={
            k: v for k, v in (event.attributes or {}).items() if k not in _FAILURE_TEXTS}, immutable=False)
        kept.dropped = event.dropped_attributes
        return Event(event.name, kept, event.timestamp)

    events = [scrubbed(e) if e.name == "exception" else e for e in span.events]
    status = Status(span.status.status_code, _failure_type(span.status.description)) \
        if span.status.description else span.status
    return _Scrubbed(span, events, status)


class _FailureTextsOut(SpanExporter):
    """Hands spans on with each failure's type and without its text (message, stack trace): Temporal's
    tracing interceptor and the OpenTelemetry SDK record an exception's message on the span it ends."""

    def __init__(self, exporter: SpanExporter) -> None:
        self._exporter = exporter

    def export(self, spans):  # noqa: ANN001, ANN201 - Sequence[ReadableSpan] -> SpanExportResult
        return self._exporter.export([_without_failure_texts(s) for s in spans])

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)


class _Without(Getter):
    """A carrier's fields, but for `hidden`."""

    def __init__(self, getter: Getter, *hidden: str) -> None:
        self._getter, self._hidden = getter, hidden

    def get(self, carrier, key: str) -> list[str] | None:  # noqa: ANN001
        return None if key.lower() in self._hidden else self._getter.get(carrier, key)

    def keys(self, carrier) -> list[str]:  # noqa: ANN001
        return [k for k in self._getter.keys(carrier) if k.lower() not in self._hidden]


class TraceParentOnly(TraceContextTextMapPropagator):
    """What a request's headers (and a model call's) carry of the trace: its `traceparent` alone. A caller's
    `baggage` and `tracestate` are free text, which would ride in every job's Temporal header (`_tracer-data`,
    which the codec does not encrypt) and in every activity's after it, and go on to the model's server."""

    def extract(self, carrier: CarrierT, context=None, getter: Getter = default_getter):  # noqa: ANN001, ANN201
        return super().extract(carrier, context, _Without(getter, "tracestate"))


# FastAPI traces every request natively too (and every dependency, with no path excluded): the
# instrumentor below does it once, without /codec's key-bearing paths.
FASTAPI_NATIVE_TELEMETRY_OFF = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}


def instrument_app(app) -> None:
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    # Scrapes and health checks are not requests anyone traces (those paths only: the patterns are searched
    # in the whole URL, and a job id may hold "metrics", tenant metrics-team's say).
    # /codec carries an operator key in its path (the Web UI's codec endpoint): never in a span.
    FastAPIInstrumentor.instrument_app(app, excluded_urls="/metrics$,/healthz$,/codec/")


def client_interceptors() -> list:
    from temporalio.contrib.opentelemetry import TracingInterceptor

    return [TracingInterceptor()]


def current_trace_id() -> str | None:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


def current_traceparent() -> str | None:
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get("traceparent")


def trace_id_of(traceparent: str | None) -> str | None:
    """The trace id in a W3C traceparent `00-<trace id>-<span id>-<flags>`."""
    parts = (traceparent or "").split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None


def context_of(traceparent: str | None):
    """An OpenTelemetry context whose current span is the one `traceparent` names (or the current one)."""
    if not traceparent:
        return otel_context.get_current()
    return _propagator.extract({"traceparent": traceparent})


@contextmanager
def attached(traceparent: str | None) -> Iterator[None]:
    """Run the block in the trace `traceparent` names (nothing changes when it is None). Usable in
    workflow code: the tracing interceptor's spans and headers follow the current context."""
    if not traceparent:
        yield
        return
    token = otel_context.attach(context_of(traceparent))
    let_go = False
    try:
        yield
    except GeneratorExit:
        # A workflow coroutine closed once its worker let go of it, maybe from another context than the one it
        # attached in: detaching there fails (and logs an error); its own context ends with it.
        let_go = True
        raise
    finally:
        if not let_go:
            otel_context.detach(token)


@contextmanager
def own_trace(name: str) -> Iterator[None]:
    """Run the block in a trace of its own whose root span `name` links to the current span. For starting a
    workflow that outlives the request starting it (a tenant's gate): its run, and every signal it handles
    for later requests, would otherwise sit in that one request's trace for as long as it runs."""
    current = trace.get_current_span().get_span_context()
    links = [trace.Link(current)] if current.is_valid else []
    with trace.get_tracer(__name__).start_as_current_span(name, context=otel_context.Context(), links=links):
        yield


def add_trace_id(logger, method_name, event_dict):
    """structlog processor: every log line carries the trace id of the span it was written under."""
    if "trace_id" not in event_dict:
        trace_id = current_trace_id()
        if trace_id:
            event_dict["trace_id"] = trace_id
    return event_dict
