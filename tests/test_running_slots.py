"""Per-tenant running slots (workflows/slot.py, workflows/gate.py) against the real stack: a tenant with
`max_running_jobs = 1` runs one job at a time while the others wait `queued` (none refused), the gate
hands out every slot exactly once across its continues-as-new, an
ingestion's documents run inside its slot, a job waiting for a person lends its slot, a cancelled job
leaves the line or gives its slot back, a job terminated by hand has its slot freed by the gate's
sweep, and other tenants are not held up."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import httpx
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.common import Priority
from temporalio.worker import Worker

from activities.gate import gate_id
from devtools.scripted_llm import last_user_message
from ragline import keys as api_keys
from models.tenancy import GateState, JobIds, SlotRequest
from tests.helpers import WaitsForSlot, delegate_until, eventually, plan_depth, read_events, until_waited
from workflows import gate as gate_module
from workflows.gate import TenantGateWorkflow


def _capped_tenant(stack, limit: int = 1) -> tuple[str, str]:
    """A fresh tenant with its own reviewer key and `max_running_jobs = limit` in the keys file."""
    tenant = f"cap-{uuid.uuid4().hex[:8]}"
    path = stack.settings.effective_api_keys_file
    key = api_keys.create(path, tenant, "reviewer", f"{tenant}-reviewer")
    with path.open("a") as f:
        f.write(f"\n[tenants.{tenant}]\nmax_running_jobs = {limit}\n")
    return tenant, key


def _client(stack, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=stack.base_url, timeout=60, headers={"Authorization": f"Bearer {key}"})


async def _status(http: httpx.AsyncClient, job_id: str) -> str:
    r = await http.get(f"/v1/jobs/{job_id}")
    assert r.status_code == 200, r.text
    return r.json()["status"]


async def _wait_status(http: httpx.AsyncClient, job_id: str, *statuses: str, timeout: float = 90) -> str:
    async def probe() -> str | None:
        status = await _status(http, job_id)
        return status if status in statuses else None
    return await eventually(probe, timeout=timeout, every=0.1, what=f"{job_id} {' or '.join(statuses)}")


async def _ask(http: httpx.AsyncClient, message: str, session_id: str | None = None, **body) -> str:
    r = await http.post("/v1/chats", json={"message": message, "collection": body.pop("collection", "slots"),
                                           **({"session_id": session_id} if session_id else {}), **body})
    assert r.status_code == 202, r.text  # accepted at once: never refused for the tenant's limit
    return r.json()["job_id"]


async def _in_line(stack, tenant: str, *job_ids: str) -> list[str]:
    """Wait until these jobs wait in their tenant's line at the gate (its `slots` query); the line."""
    gate = stack.client.get_workflow_handle(gate_id(tenant, stack.settings.task_queue))

    async def probe() -> list[str] | None:
        waiting = (await gate.query(TenantGateWorkflow.slots)).waiting
        return waiting if set(job_ids) <= set(waiting) else None
    return await eventually(probe, timeout=60, every=0.1, what=f"{len(job_ids)} job(s) in {tenant}'s line")


async def _seed(http: httpx.AsyncClient, collection: str = "slots") -> str:
    """A collection with one passage, so that turns asked on it call the model."""
    r = await http.post("/v1/documents", data={"collection": collection},
                        files=[("files", ("keeper.txt", b"The keeper lights the lamp at dusk, every day."))])
    assert r.status_code == 202, r.text
    job_id = r.json()["job_id"]
    assert await _wait_status(http, job_id, "completed", "failed") == "completed"
    return job_id


async def _busy_span(stack, job_id: str) -> tuple[float, float]:
    """From the job's first step under its slot (activity or child job) to its last step done, server
    clock. Asking for the slot is not under it, nor is a turn's retrieval, which runs meanwhile."""
    history = await stack.client.get_workflow_handle(job_id).fetch_history()
    starts, ends = [], []
    for e in history.events:
        at = e.event_time.ToDatetime().timestamp()
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            if e.activity_task_scheduled_event_attributes.activity_type.name not in ("retrieve_context",
                                                                                     "acquire_slot"):
                starts.append(at)
        elif e.event_type == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED:
            starts.append(at)
        elif e.event_type in (EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED,
                              EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_COMPLETED):
            ends.append(at)
    return min(starts), max(ends)


async def _a_tree_whose_sub_agent_waits_for_review(http: httpx.AsyncClient, goal: str,
                                                   collection: str) -> tuple[str, dict]:
    """An agent of max_depth 1 whose scripted plans delegate deeper: its sub-agent's depth guard asks a
    reviewer. The root's job id and that review."""
    r = await http.post("/v1/agents", json={"goal": goal, "collection": collection, "max_depth": 1})
    root = r.json()["job_id"]

    async def sub_agent_review() -> dict | None:
        reviews = (await http.get("/v1/reviews")).json()["reviews"]
        return next((x for x in reviews if x["job_id"].startswith(f"{root}.")), None)
    return root, await eventually(sub_agent_review, timeout=60, what="the sub-agent's review")


@dataclass
class Held:
    """A capped tenant's turn that holds the tenant's one slot: the model holds its answer back until
    `release` is set (or the block ends). Other turns put `others.token` in their question."""
    holder: str
    others: object
    release: asyncio.Event = field(default_factory=asyncio.Event)


@asynccontextmanager
async def _a_turn_holding_the_slot(stack, http: httpx.AsyncClient) -> AsyncIterator[Held]:
    release = asyncio.Event()

    async def held_back(_request: dict) -> dict:
        await release.wait()
        return {"content": "The keeper lights the lamp at dusk [1]."}

    with stack.llm.scope() as holding, stack.llm.scope() as others:
        holding.script_fn("answer", held_back)
        try:
            holder = await _ask(http, f"When is the lamp lit? {holding.token}")
            await holding.wait_for_calls(1, "answer", timeout=60)  # under way: it holds the slot
            yield Held(holder=holder, others=others, release=release)
        finally:
            release.set()


async def test_a_capped_tenant_runs_one_job_at_a_time_and_queues_the_rest(stack):
    tenant, key = _capped_tenant(stack, limit=1)
    async with _client(stack, key) as http:
        # An ingestion holds the one slot; its document child jobs run inside it (no deadlock).
        ingest = await _seed(http)
        async with _a_turn_holding_the_slot(stack, http) as held:
            waiting = [await _ask(http, f"When is the lamp lit? ({n}) {held.others.token}") for n in (1, 2)]
            await _in_line(stack, tenant, *waiting)
            for job_id in waiting:  # (once it has heard so from the gate: retrieval may run meanwhile)
                await _wait_status(http, job_id, "queued")

            async def listed() -> bool:
                jobs = (await http.get("/v1/jobs", params={"status": "queued", "limit": 1000})).json()["jobs"]
                return {j["job_id"] for j in jobs} >= set(waiting)
            await eventually(listed, what="both turns listed as queued")
            assert await _status(http, held.holder) == "running"
            assert held.others.count("answer") == 0
            held.release.set()
            chats = [held.holder, *waiting]
            for job_id in chats:
                assert await _wait_status(http, job_id, "completed", "failed") == "completed"

        events = [e for _, e in await read_events(SimpleNamespace(http=http), waiting[-1])]
        [queued] = [e for e in events if e["type"] == "ragline.job.queued"]
        assert queued["data"]["reason"] == "tenant_running_jobs" and queued["data"]["limit"] == 1
        assert queued["data"]["position"] >= 1
        # Never two at once: each job's steps begin after the one before finished its last.
        spans = sorted([await _busy_span(stack, j) for j in [ingest, *chats]])
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert start >= end, spans


async def test_a_gate_holding_all_it_may_refuses_the_next_job_which_fails_saying_so(stack, monkeypatch):
    """The gate carries every job of its tenant that runs or waits through its continue-as-new, and Temporal
    refuses an input over 2 MB: at about 15,000 queued jobs its every workflow task failed, and every job of
    the tenant, queued and new, waited for ever. Past MAX_IN_GATE (here 2) a new job fails at once, saying
    why; the jobs it holds run on, and once one has ended the gate takes jobs again."""
    monkeypatch.setattr(gate_module, "MAX_IN_GATE", 2)
    tenant, key = _capped_tenant(stack, limit=1)
    async with _client(stack, key) as http:
        await _seed(http)
        async with _a_turn_holding_the_slot(stack, http) as held:
            waiting = await _ask(http, f"When is the lamp lit? (1) {held.others.token}")
            await _in_line(stack, tenant, waiting)
            refused = await _ask(http, f"When is the lamp lit? (2) {held.others.token}")
            assert await _wait_status(http, refused, "failed", "completed") == "failed"
            job = (await http.get(f"/v1/jobs/{refused}")).json()
            assert job["error"]["type"] == "TenantBusy", job
            assert f"2 jobs of tenant {tenant} already run or wait" in job["error"]["message"], job
            assert held.others.count("answer") == 0  # no model call for it
            held.release.set()
            for job_id in (held.holder, waiting):
                assert await _wait_status(http, job_id, "completed", "failed") == "completed"
        again = await _ask(http, "When is the lamp lit? (3)")
        assert await _wait_status(http, again, "completed", "failed") == "completed"


async def test_a_gate_has_a_bounded_number_of_answers_on_their_way_and_every_job_hears(stack, monkeypatch):
    """Temporal fails a workflow task that would leave over 2,000 signals pending: a gate answering thousands
    of jobs at once (a raised limit granting its whole line, a burst) stalled its tenant. Here at most one
    answer is on its way at a time, and every job still hears its standing and runs."""
    monkeypatch.setattr(gate_module, "MAX_SENDING", 1)
    tenant, key = _capped_tenant(stack, limit=1)
    async with _client(stack, key) as http:
        await _seed(http)
        async with _a_turn_holding_the_slot(stack, http) as held:
            waiting = [await _ask(http, f"When is the lamp lit? ({n}) {held.others.token}") for n in range(4)]
            await _in_line(stack, tenant, *waiting)
            # An operator raises the tenant's limit: the next job's ask carries it, and the gate grants its
            # whole line at once.
            path = stack.settings.effective_api_keys_file
            path.write_text(path.read_text().replace(f"[tenants.{tenant}]\nmax_running_jobs = 1\n",
                                                     f"[tenants.{tenant}]\nmax_running_jobs = 10\n"))
            waiting.append(await _ask(http, f"When is the lamp lit? (late) {held.others.token}"))
            for job_id in waiting:
                assert await _wait_status(http, job_id, "completed", "failed") == "completed"
            held.release.set()
            assert await _wait_status(http, held.holder, "completed", "failed") == "completed"
    on_the_way, most = set(), 0
    async for event in stack.client.get_workflow_handle(gate_id(tenant, stack.settings.task_queue)
                                                        ).fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED:
            on_the_way.add(event.event_id)
        elif event.event_type == EventType.EVENT_TYPE_EXTERNAL_WORKFLOW_EXECUTION_SIGNALED:
            on_the_way.discard(event.external_workflow_execution_signaled_event_attributes.initiated_event_id)
        elif event.event_type == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_FAILED:
            on_the_way.discard(event.signal_external_workflow_execution_failed_event_attributes.initiated_event_id)
        most = max(most, len(on_the_way))
    assert most == 1, most


async def test_a_job_waiting_for_a_person_lends_its_slot(stack):
    tenant, key = _capped_tenant(stack, limit=1)
    async with _client(stack, key) as http:
        await _seed(http, "lend")
        held = await _ask(http, "When is high tide?", collection="lend", require_review=True)
        assert await _wait_status(http, held, "waiting_review") == "waiting_review"
        # Another turn of the same tenant runs to the end while the first waits for its reviewer.
        other = await _ask(http, "Is it low tide at six?", collection="lend")
        assert await _wait_status(http, other, "completed", "failed") == "completed"

        r = await http.post(f"/v1/jobs/{held}/review", json={"decision": "approve", "reviewer": "editor"})
        assert r.status_code < 300, r.text
        assert await _wait_status(http, held, "completed", "failed") == "completed"


async def test_a_turn_reviewed_while_its_summary_runs_lends_its_slot_only_once_that_ends(stack):
    """A held answer is put to its reviewer while the turn's summary and entities run: model calls, which the
    tenant's cap is for. The turn keeps its slot until they end, then lends it for the rest of the review."""
    tenant, key = _capped_tenant(stack, limit=1)
    async with _client(stack, key) as http:
        await _seed(http, "beside")
        with stack.llm.scope() as llm:
            def held_turns_side_steps_take_a_while(request: dict) -> dict | None:
                return {"content": "[]", "delay": 2} if "high tide" in last_user_message(request["messages"]) else None
            llm.script_fn("summarize", held_turns_side_steps_take_a_while)
            llm.script_fn("extract_entities", held_turns_side_steps_take_a_while)
            held = await _ask(http, f"When is high tide? {llm.token}", collection="beside", require_review=True)
            assert await _wait_status(http, held, "waiting_review") == "waiting_review"
            other = await _ask(http, f"Who lights the lamp? {llm.token}", collection="beside")
            assert await _wait_status(http, other, "completed", "failed") == "completed"
            assert await _status(http, held) == "waiting_review"

            r = await http.post(f"/v1/jobs/{held}/review", json={"decision": "approve", "reviewer": "editor"})
            assert r.status_code < 300, r.text
            assert await _wait_status(http, held, "completed", "failed") == "completed"
            job = (await http.get(f"/v1/jobs/{held}")).json()
    _, side_steps_ended = await _busy_span(stack, held)
    other_began, _ = await _busy_span(stack, other)
    assert other_began >= side_steps_ended
    assert job["result"]["summary"] == "[]" and job["result"]["review"]["reviewer"] == "editor"


async def test_a_side_step_parked_while_its_answer_waits_for_review_lends_the_slot(stack):
    """The summary run beside a review keeps failing and waits for an operator: nothing of the turn runs, so
    the tenant's other work goes on instead of waiting for the operator or the reviewer, and the review is
    still listed. Retried, the summary runs in the slot taken back, which is lent again once it ends."""
    tenant, key = _capped_tenant(stack, limit=1)
    async with _client(stack, key) as http:
        await _seed(http, "parked-beside")
        with stack.llm.scope() as llm:
            llm.script_fn("summarize", lambda request: "503" if "high tide" in last_user_message(
                request["messages"]) else None)
            held = await _ask(http, f"When is high tide? {llm.token}", collection="parked-beside",
                              require_review=True)
            assert await _wait_status(http, held, "dead_lettered") == "dead_lettered"

            async def listed() -> list[dict]:  # from visibility, which shows the job's status a moment after it
                return (await http.get("/v1/reviews")).json()["reviews"]
            reviews = await eventually(listed, what="the held turn's review listed")
            assert [(r["job_id"], r["reason"]) for r in reviews] == [(held, "review requested")]
            other = await _ask(http, f"Who lights the lamp? {llm.token}", collection="parked-beside")
            assert await _wait_status(http, other, "completed", "failed") == "completed"

            llm.script_fn("summarize", None)
            r = await http.post(f"/v1/jobs/{held}/retry", json={"operator": "ops"})
            assert r.status_code == 200, r.text
            assert await _wait_status(http, held, "waiting_review") == "waiting_review"
            another = await _ask(http, f"Is the lamp lit at dusk? {llm.token}", collection="parked-beside")
            assert await _wait_status(http, another, "completed", "failed") == "completed"

            r = await http.post(f"/v1/jobs/{held}/review", json={"decision": "approve", "reviewer": "editor"})
            assert r.status_code == 200, r.text
            assert await _wait_status(http, held, "completed", "failed") == "completed"
            job = (await http.get(f"/v1/jobs/{held}")).json()
    assert job["result"]["summary"] and job["result"]["review"]["reviewer"] == "editor"


async def test_a_sub_agent_waiting_for_a_person_lends_its_trees_slot(stack):
    """A sub-agent runs within its root's slot; when it waits for a reviewer (here: its depth guard), the
    root, which only waits on it, lends the slot: the tenant's other work runs meanwhile instead of
    waiting as long as the reviewer does (24 h by default)."""
    tenant, key = _capped_tenant(stack, limit=1)
    async with _client(stack, key) as http:
        await _seed(http, "subs")
        with stack.llm.scope() as agent:
            agent.script_fn("agent", delegate_until(leaf_depth=9, token=agent.token))
            root, review = await _a_tree_whose_sub_agent_waits_for_review(http, f"Survey every lamp {agent.token}",
                                                                          "subs")
            assert await _status(http, root) == "running"  # the root waits on its child, not on a person
            other = await _ask(http, "When is the lamp lit?", collection="subs")
            assert await _wait_status(http, other, "completed", "failed") == "completed"

            r = await http.post(f"/v1/jobs/{review['job_id']}/review", json={"decision": "reject", "reviewer": "ed"})
            assert r.status_code == 200, r.text
            assert await _wait_status(http, root, "completed", "failed") == "completed"


async def test_an_agent_is_not_charged_for_the_time_it_waits_in_line_for_its_tenants_slot(stack):
    """A capped tenant's agent waits in line behind a turn that holds the slot, longer than its whole time
    budget; once it has the slot it works on the time it was given, and finishes. Before, the line was
    charged: the agent came out of it out of time and asked a reviewer ("time budget used up") before
    doing any work."""
    tenant, key = _capped_tenant(stack, limit=1)
    async with _client(stack, key) as http:
        await _seed(http)
        async with _a_turn_holding_the_slot(stack, http) as held:
            with stack.llm.scope() as agent:
                agent.script_fn("agent", lambda body: {
                    "tool_calls": [{"name": "finish", "arguments": {"answer": "at dusk"}}]})
                r = await http.post("/v1/agents", json={
                    "goal": f"When is the lamp lit? {agent.token}", "collection": "slots",
                    "budget": {"max_llm_calls": 10, "max_tokens": 100000, "max_seconds": 4}})
                assert r.status_code == 202, r.text
                job_id = r.json()["job_id"]
                await _in_line(stack, tenant, job_id)
                # Its clock started at its first workflow task (server time): in line until 5 s past it.
                history = await stack.client.get_workflow_handle(job_id).fetch_history()
                began = next(e.event_time.ToDatetime(timezone.utc) for e in history.events
                             if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED)
                past_its_budget = began + timedelta(seconds=5) - datetime.now(timezone.utc)
                await asyncio.sleep(max(0.0, past_its_budget.total_seconds()))
                assert await _status(http, job_id) == "queued"
                held.release.set()
                status = await _wait_status(http, job_id, "completed", "failed", "waiting_review")
                job = (await http.get(f"/v1/jobs/{job_id}")).json()
    assert status == "completed", job
    result = job["result"]
    assert (result["status"], result["answer"], result["decisions"]) == ("finished", "at dusk", [])
    assert result["granted"]["seconds"] == 0  # the line moved its deadline, but granted it nothing


async def test_a_root_that_waits_in_line_while_its_tree_works_is_not_given_that_wait(stack):
    """A sub-agent's depth review waits 1 s while its root lends the tree's slot, which another job takes.
    Approved, the sub-agent works on while the root waits in line to take the slot back, longer than the
    review waited: that wait held up none of the tree's work, so it moves no deadline, and the root's
    `granted.seconds` still shows the review's wait. Counted, it moved the root's deadline past the one the
    sub-agent came back with, and `granted.seconds` read 0."""
    tenant, key = _capped_tenant(stack, limit=1)
    async with _client(stack, key) as http:
        await _seed(http)
        may_plan = asyncio.Event()
        with stack.llm.scope() as agent:
            plan = delegate_until(leaf_depth=2, token=agent.token)

            async def deepest_waits(body: dict) -> dict:  # the sub-agent's own sub-agent, until the root holds the slot
                if plan_depth(body) == 2:
                    await may_plan.wait()
                return plan(body)
            agent.script_fn("agent", deepest_waits)
            root, review = await _a_tree_whose_sub_agent_waits_for_review(http, f"Survey every lamp {agent.token}",
                                                                          "slots")
            async with _a_turn_holding_the_slot(stack, http) as held:  # it runs in the slot the root lent
                await until_waited(review, 1)
                r = await http.post(f"/v1/jobs/{review['job_id']}/review", json={
                    "decision": "approve", "reviewer": "ed", "extra_depth": 1, "requested_at": review["requested_at"]})
                assert r.status_code == 200, r.text
                await _in_line(stack, tenant, root)  # to take the slot back, while its sub-agent works
                await asyncio.sleep(2)  # longer in line than the review waited
                held.release.set()
            gate = stack.client.get_workflow_handle(gate_id(tenant, stack.settings.task_queue))

            async def root_holds() -> bool:
                return root in (await gate.query(TenantGateWorkflow.slots)).holders
            await eventually(root_holds, timeout=60, every=0.1, what="the root holding the slot again")
            may_plan.set()
            status = await _wait_status(http, root, "completed", "failed", "waiting_review")
            job = (await http.get(f"/v1/jobs/{root}")).json()
    assert status == "completed", job
    assert job["result"]["status"] == "finished", job["result"]
    assert job["result"]["granted"]["seconds"] >= 1, job["result"]["granted"]


async def test_a_decision_lands_at_once_and_the_slot_is_asked_for_again_only_for_more_work(stack):
    """While another job holds the lent slot: a chat turn whose answer a reviewer releases completes at once
    (it has no more work that needs a slot); an agent that is told to go on waits, queued, for the slot, and
    its decision stands (a second one is refused instead of being taken and dropped)."""
    tenant, key = _capped_tenant(stack, limit=1)
    async with _client(stack, key) as http:
        await _seed(http)
        with stack.llm.scope() as agent:
            agent.script_fn("agent", lambda body: (
                {"tool_calls": [{"name": "finish", "arguments": {"answer": "done as told"}}]}
                if "a reviewer said" in last_user_message(body["messages"]) else
                {"tool_calls": [{"name": "delegate", "arguments": {"subgoal": f"a smaller part {agent.token}"}}]}))
            turn = await _ask(http, "When is the lamp lit?", require_review=True)
            r = await http.post("/v1/agents", json={"goal": f"Map the lamps {agent.token}", "collection": "slots",
                                                    "max_depth": 0})
            tree = r.json()["job_id"]
            for job_id in (turn, tree):
                assert await _wait_status(http, job_id, "waiting_review") == "waiting_review"
            async with _a_turn_holding_the_slot(stack, http) as busy:
                r = await http.post(f"/v1/jobs/{turn}/review", json={"decision": "approve", "reviewer": "editor"})
                assert r.status_code == 200, r.text
                assert await _wait_status(http, turn, "completed", "failed") == "completed"
                r = await http.post(f"/v1/jobs/{tree}/review", json={
                    "decision": "revise", "reviewer": "editor", "instructions": "answer without delegating"})
                assert r.status_code == 200, r.text
                assert await _wait_status(http, tree, "queued") == "queued"
                again = await http.post(f"/v1/jobs/{tree}/review", json={"decision": "reject", "reviewer": "late"})
                assert (again.status_code, again.json()["error"]["code"]) == (409, "not_waiting_for_review")
                assert await _status(http, busy.holder) == "running"
            assert await _wait_status(http, tree, "completed", "failed") == "completed"
            job = (await http.get(f"/v1/jobs/{tree}")).json()
    assert job["status"] == "completed" and job["result"]["answer"] == "done as told"
    assert [d["reviewer"] for d in job["result"]["decisions"]] == ["editor"]


async def test_a_slot_held_by_a_terminated_job_is_freed_and_other_tenants_are_not_held_up(stack):
    tenant, key = _capped_tenant(stack, limit=1)
    # Acme's documents first: the holder's held model call times out, and after its attempts (~20 s) parks and
    # lends the slot, so what runs while it holds the slot must be short (on a slow host an upload was not).
    await _seed(stack.http)
    async with _client(stack, key) as http:
        await _seed(http)
        async with _a_turn_holding_the_slot(stack, http) as held:
            waiter = await _ask(http, f"Anyone? {held.others.token}")
            await _in_line(stack, tenant, waiter)
            await _wait_status(http, waiter, "queued")

            # The limit is per tenant: acme's turn, which calls the model too, does not wait behind this
            # tenant's line.
            ours = await stack.chat(f"Unrelated question {held.others.token}", collection="slots")
            done = await stack.wait_done(ours["job_id"])
            assert done["status"] == "completed" and done["result"]["model"] == "scripted", done
            assert await _status(http, waiter) == "queued"

            # Terminated by hand, the holder never gives its slot back: the gate's sweep frees it.
            await stack.client.get_workflow_handle(held.holder).terminate(reason="test: a stuck job")
            assert await _wait_status(http, waiter, "completed", "failed", timeout=60) == "completed"
            # Its view says how it ended, and leaves no step running for ever.
            job = (await http.get(f"/v1/jobs/{held.holder}")).json()
            assert job["status"] == "failed" and not [st for st in job["steps"] if st["status"] == "running"], job
            [answer] = [st for st in job["steps"] if st["name"] == "generate_answer"]
            assert answer["status"] == "failed" and "terminated" in answer["error"], answer


async def test_cancelled_jobs_leave_the_line_and_give_their_slot_back(stack):
    tenant, key = _capped_tenant(stack, limit=1)
    gate = stack.client.get_workflow_handle(gate_id(tenant, stack.settings.task_queue))
    async with _client(stack, key) as http:
        await _seed(http)
        async with _a_turn_holding_the_slot(stack, http) as held:
            first, second = [await _ask(http, f"Anyone? ({n}) {held.others.token}") for n in (1, 2)]
            line = await _in_line(stack, tenant, first, second)
            assert sorted(line) == sorted([first, second])

            # Cancelled while in line: it leaves the line at once.
            await stack.client.get_workflow_handle(first).cancel()
            await _wait_status(http, first, "cancelled")
            assert (await gate.query(TenantGateWorkflow.slots)).waiting == [second]

            # Cancelled while running: its slot goes to the next in line.
            await stack.client.get_workflow_handle(held.holder).cancel()
            await _wait_status(http, held.holder, "cancelled")
            events = [e for _, e in await read_events(SimpleNamespace(http=http), held.holder)]
            assert events[-1]["type"] == "ragline.job.cancelled"
            assert await _wait_status(http, second, "completed", "failed") == "completed"
            assert held.others.count("answer") == 1  # the cancelled one never asked the model


@activity.defn(name="ended_jobs")
async def none_ended(req: JobIds) -> JobIds:
    return JobIds(job_ids=[])


async def test_the_gate_hands_out_every_slot_once_across_continue_as_new(stack):
    """The gate alone (jobs stood for by WaitsForSlot), on the real server: thirty jobs ask at once,
    three run, and as each gives its slot back the next in line gets it, while the gate continues as
    new every few dozen events (signals that arrive meanwhile go to the new run)."""
    queue = f"gate-{uuid.uuid4().hex[:8]}"
    async with Worker(stack.client, task_queue=queue, workflows=[TenantGateWorkflow, WaitsForSlot],
                      activities=[none_ended]):
        started = await stack.client.start_workflow(
            TenantGateWorkflow.run, GateState(tenant="t", limit=3, rotate_after=40), id=f"t.gate.{queue}",
            task_queue=queue, priority=Priority(priority_key=1))
        gate = stack.client.get_workflow_handle(started.id)  # whichever run is current, as jobs address it
        jobs = [f"t.job-{n}-{uuid.uuid4().hex[:6]}" for n in range(30)]
        waiters = [await stack.client.start_workflow(WaitsForSlot.run, id=j, task_queue=queue) for j in jobs]
        try:
            await asyncio.gather(*(gate.signal(TenantGateWorkflow.acquire, SlotRequest(tenant="t", job_id=j))
                                   for j in jobs))
            finished: list[str] = []
            while len(finished) < len(jobs):
                async def next_holder() -> str | None:
                    holders = (await gate.query(TenantGateWorkflow.slots)).holders
                    assert len(holders) <= 3
                    return next((j for j in holders if j not in finished), None)
                job_id = await eventually(next_holder, timeout=20, what=f"a slot holder after {len(finished)}")
                # As a job does, it gives its slot back only after it heard it had one (a gate that is
                # about to continue as new tells the holders it granted from its next run).
                await asyncio.wait_for(waiters[jobs.index(job_id)].result(), 20)
                await gate.signal(TenantGateWorkflow.release, SlotRequest(tenant="t", job_id=job_id))
                finished.append(job_id)
            assert sorted(finished) == sorted(jobs)  # every job got a slot, none twice
            for handle in waiters:  # and each heard it may run
                assert any(s["granted"] for s in await handle.result())
            state = await gate.query(TenantGateWorkflow.slots)
            assert (state.holders, state.waiting, state.tickets) == ([], [], {})
            now = await gate.describe()
            assert now.run_id != started.run_id  # it continued as new on the way
            assert now.raw_description.workflow_execution_info.priority.priority_key == 1  # still first in line
        finally:
            await gate.terminate("test over")
