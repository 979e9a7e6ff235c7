"""A job's live events: CloudEvents 1.0 objects on its durable stream
(`temporalio.contrib.workflow_streams`), which the API relays as Server-Sent Events. Each carries the
W3C `traceparent` of the request that started the job (the CloudEvents distributed-tracing extension),
read from the run's tracing header.

Every event that enters the stream wakes the stream's waiting poll, and each poll is an Update: a
workflow task on the worker and a write on the server. A job that sets `hold_steps` keeps the events
nobody waits for (`RIDE_ALONG`: accepted, a step started or completed) until the next event a person
does wait for (an answer delta an activity publishes, the answer, queued, a review, a failure, the
end), which carries them out in order in one read."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from temporalio import workflow
from temporalio.contrib.workflow_streams import PollInput, PollResult, PublishInput, WorkflowStream
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from models.jobs import EVENTS_TOPIC
    from temporal import policies


# Histories recorded before the terminal event waited for a watching subscriber replay without it.
LINGER_PATCH = "events-linger-for-subscriber"
# ... and a cancel that came after the terminal event ended the job cancelled, whatever that event said.
TERMINAL_EVENT_STANDS_PATCH = "cancel-after-terminal-event-changes-nothing"
# Histories recorded before step events could ride along replay with every event published at once:
# the polls they record returned at those points.
HOLD_PATCH = "events-ride-along"
# The events that wait for the next one a person waits for, in a job that holds them.
RIDE_ALONG = frozenset({"ragline.job.accepted", "ragline.step.started", "ragline.step.completed"})
# The signal that carries what activities and clients publish into the stream, and the Update that polls
# it (the library's protocol).
PUBLISH_SIGNAL = "__temporal_workflow_stream_publish"
POLL_UPDATE = "__temporal_workflow_stream_poll"
# Temporal admits 10 Updates in flight per workflow and 2,000 per run, and a reviewer's decision or an
# operator's retry is an Update too. A poll waits in the workflow until the next event, and the server keeps
# it in flight after its reader has gone (an SSE client that reconnects, an API restarted): past
# MAX_WAITING_POLLS waiting, the oldest returns empty (a reader still there polls again); past
# MAX_POLLS_PER_RUN accepted, polls are refused (POLLS_SPENT) and the API reads the stream by query.
MAX_WAITING_POLLS = 5
MAX_POLLS_PER_RUN = 1500
POLLS_SPENT = "StreamPollsSpent"
STREAM_DRAINING = "StreamDraining"  # the library's types: a poll sent while the run ends is asked again,
TRUNCATED_OFFSET = "TruncatedOffset"  # one for events no longer kept starts over
# Histories recorded before a poll could be answered early (past MAX_WAITING_POLLS) replay without that.
POLLS_BOUNDED_PATCH = "stream-polls-bounded"


class JobEvents:
    def __init__(self) -> None:
        self.stream = WorkflowStream()
        self._topic = self.stream.topic(EVENTS_TOPIC)
        self._published = 0
        self._traceparent: str | None = None
        # Merged into every event's data (an agent adds its depth).
        self.context: dict[str, Any] = {}
        self._watched = False  # a subscriber has been seen waiting for events
        # Whether RIDE_ALONG events wait for the next event a person waits for (a chat turn: seconds).
        self.hold_steps = False
        self._held: list[dict[str, Any]] = []
        # What is held goes into the stream before what an activity publishes (answer deltas).
        append_published = workflow.get_signal_handler(PUBLISH_SIGNAL)

        def publish_after_held(batch: PublishInput) -> None:
            self.release()
            append_published(batch)

        workflow.set_signal_handler(PUBLISH_SIGNAL, publish_after_held)
        self._polls = 0  # accepted this run
        self._waiting_polls: deque[object] = deque()
        self._answered_early: set[object] = set()
        self._bounded: bool | None = None
        workflow.set_update_handler(POLL_UPDATE, self._bounded_poll, validator=self._validate_poll)

    async def _bounded_poll(self, poll: PollInput) -> PollResult:
        """The library's poll, answered empty should MAX_WAITING_POLLS newer ones wait (a gone reader's). Its
        wait and batch are the library's own (`WorkflowStream._on_poll`), inline rather than awaited as a task
        of their own: a poll's answer must leave in the workflow task, and among its commands, where it did.
        (It reads the stream's private state: tests/test_events.py and the replay tests fail should that change.)"""
        self._polls += 1
        mine = object()
        self._waiting_polls.append(mine)
        if len(self._waiting_polls) > MAX_WAITING_POLLS and self._polls_bounded():
            self._answered_early.add(self._waiting_polls.popleft())
        stream = self.stream
        try:
            await workflow.wait_condition(
                lambda: poll.from_offset < stream._base_offset
                or len(stream._log) > poll.from_offset - stream._base_offset
                or stream._detaching or mine in self._answered_early)
        finally:
            if mine in self._waiting_polls:
                self._waiting_polls.remove(mine)
            self._answered_early.discard(mine)
        if poll.from_offset != 0 and poll.from_offset < stream._base_offset:
            raise ApplicationError(f"Requested offset {poll.from_offset} has been truncated. Current base offset "
                                   f"is {stream._base_offset}.", type=TRUNCATED_OFFSET)
        return stream._collect_batch(poll)  # (answered early: nothing new, an empty batch)

    def _validate_poll(self, _poll: PollInput) -> None:
        # (A validator issues no command, and a refused Update leaves no trace in the history: no patch.)
        if self.stream._detaching:
            raise ApplicationError("the job's stream is closing", type=STREAM_DRAINING)
        if self._polls >= MAX_POLLS_PER_RUN:
            raise ApplicationError(f"this job's stream has answered {self._polls} polls: read it by query",
                                   type=POLLS_SPENT)

    def _polls_bounded(self) -> bool:
        if self._bounded is None:
            self._bounded = workflow.patched(POLLS_BOUNDED_PATCH)
        return self._bounded

    def traceparent(self) -> str | None:
        if self._traceparent is None:
            header = workflow.info().headers.get("_tracer-data")  # temporalio.contrib.opentelemetry's
            carrier = workflow.payload_converter().from_payloads([header])[0] if header else {}
            self._traceparent = (carrier or {}).get("traceparent") or ""
        return self._traceparent or None

    def emit(self, type_: str, data: dict[str, Any] | None = None, *, in_signal: bool = False) -> None:
        """`in_signal`: emitted by a signal handler, which is itself a handler in flight: it says nothing
        of a subscriber waiting."""
        self._watched = self._watched or (not in_signal and self._subscriber_waiting())
        event = self._event(type_, data)
        if self.hold_steps and type_ in RIDE_ALONG:
            self._held.append(event)
            return
        self.release()
        self._topic.publish(event)

    def publish_unsent(self, events: list[dict[str, Any]]) -> None:
        """Events an activity built and left for the job to publish with its result (workflows/job.py)."""
        self.release()
        for event in events:
            self._topic.publish(event)

    @contextmanager
    def shown_at_once(self) -> Iterator[None]:
        """Meanwhile nothing is held: what was held goes out with the next event, and every event after it."""
        held, self.hold_steps = self.hold_steps, False
        try:
            yield
        finally:
            self.hold_steps = held

    def release(self) -> None:
        """Publish the held events now: the job is about to wait for something other than its own steps."""
        held, self._held = self._held, []
        for event in held:
            self._topic.publish(event)

    def _event(self, type_: str, data: dict[str, Any] | None) -> dict[str, Any]:
        info = workflow.info()
        self._published += 1
        traceparent = self.traceparent()
        return {
            **({"traceparent": traceparent} if traceparent else {}),
            "specversion": "1.0",
            "id": f"{info.workflow_id}/{info.run_id[:8]}/{self._published}",
            "source": f"ragline/{info.workflow_type}",
            "type": type_,
            "time": workflow.now().isoformat(),
            "subject": info.workflow_id,
            "datacontenttype": "application/json",
            "data": {**self.context, **(data or {})},
        }

    async def close(self, type_: str, data: dict[str, Any] | None = None, *, linger: bool = True) -> None:
        """Publish the terminal event, release subscribers and let handlers drain before the run ends.

        With `linger`, a job someone watches and whose subscriber is between two polls waits for the
        next poll (`[events] subscriber_grace` in the policy file), which carries the terminal event out with the run's last workflow task. A
        poll that came after the run closed would be answered by a query, which a worker serves by
        replaying the whole history."""
        poll_waiting = self._subscriber_waiting()
        self.emit(type_, data)  # a waiting poll returns with it; the next one finds it in the log
        try:
            if linger and self._watched and not poll_waiting and workflow.patched(LINGER_PATCH):
                try:
                    await workflow.wait_condition(self._subscriber_waiting, timeout=policies.subscriber_grace())
                except asyncio.TimeoutError:
                    pass  # the subscriber has gone: it can read the rest from the closed run
            self.stream.detach_pollers()
            await workflow.wait_condition(workflow.all_handlers_finished)
        except asyncio.CancelledError:
            # A cancel that arrives once the terminal event is out changes nothing: the job ends as that
            # event said (a completed job keeps its result). Earlier jobs ended cancelled.
            if not workflow.patched(TERMINAL_EVENT_STANDS_PATCH):
                raise
            self.stream.detach_pollers()
            await workflow.wait_condition(workflow.all_handlers_finished)

    @staticmethod
    def _subscriber_waiting() -> bool:
        # A subscriber that has caught up waits inside the workflow: a stream poll is the one handler
        # that stays in flight (the operator Updates and every signal return at once).
        return not workflow.all_handlers_finished()
