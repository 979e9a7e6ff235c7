"""A job's live events: CloudEvents 1.0 objects on its durable stream
(`temporalio.contrib.workflow_streams`), which the API relays as Server-Sent Events. Each carries the
W3C `traceparent` of the request that started the job (the CloudEvents distributed-tracing extension),
read from the run's tracing header."""

from __future__ import annotations

from typing import Any

from temporalio import workflow
from temporalio.contrib.workflow_streams import WorkflowStream

with workflow.unsafe.imports_passed_through():
    from models.jobs import EVENTS_TOPIC


class JobEvents:
    def __init__(self) -> None:
        self.stream = WorkflowStream()
        self._topic = self.stream.topic(EVENTS_TOPIC)
        self._published = 0
        self._traceparent: str | None = None
        # Merged into every event's data (an agent adds its depth).
        self.context: dict[str, Any] = {}

    def traceparent(self) -> str | None:
        if self._traceparent is None:
            header = workflow.info().headers.get("_tracer-data")  # temporalio.contrib.opentelemetry's
            carrier = workflow.payload_converter().from_payloads([header])[0] if header else {}
            self._traceparent = (carrier or {}).get("traceparent") or ""
        return self._traceparent or None

    def emit(self, type_: str, data: dict[str, Any] | None = None) -> None:
        info = workflow.info()
        self._published += 1
        traceparent = self.traceparent()
        self._topic.publish({
            **({"traceparent": traceparent} if traceparent else {}),
            "specversion": "1.0",
            "id": f"{info.workflow_id}/{info.run_id[:8]}/{self._published}",
            "source": f"ragline/{info.workflow_type}",
            "type": type_,
            "time": workflow.now().isoformat(),
            "subject": info.workflow_id,
            "datacontenttype": "application/json",
            "data": {**self.context, **(data or {})},
        })

    async def close(self, type_: str, data: dict[str, Any] | None = None) -> None:
        """Publish the terminal event, release subscribers and let handlers drain before the run ends."""
        self.emit(type_, data)
        self.stream.detach_pollers()
        await workflow.wait_condition(workflow.all_handlers_finished)
