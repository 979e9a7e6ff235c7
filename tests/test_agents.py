"""Agents delegate to sub-agents as child workflows; guards stop them for human review.

Each test drives the shared scripted model in a scope of its own: its goals (and the sub-goals its
script delegates) carry the scope's token, so its script answers only its own agents' plans, and it
looks only at the reviews and model calls of its own tree."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import datetime, timedelta

from devtools.devserver import temporal_binary
from devtools.scripted_llm import parse_prompt
from ragline.llm import question_budget
from tests.conftest import running_stack
from tests.helpers import (
    delegate_until, delegating, eventually, fresh_plan, plan_depth, plan_goal, read_events, session_turns,
    two_sub_agents_that_delegate_deeper, until_waited, waiting_reviews,
)
from workflows.agent import MAX_TURNS


async def _start(stack, goal: str, **extra) -> str:
    r = await stack.http.post("/v1/agents", json={"goal": goal, "collection": "agents", **extra})
    assert r.status_code == 202, r.text
    return r.json()["job_id"]


async def _tree_reviews(stack, job_id: str) -> list[dict]:
    reviews = (await stack.http.get("/v1/reviews")).json()["reviews"]
    return [r for r in reviews if r["job_id"] == job_id or r["job_id"].startswith(f"{job_id}.")]


async def _ended_or_asked_again(stack, job_id: str, review: dict) -> dict:
    """The agent's job once it ended, or `{"asked again": [...]}` once its tree asked a review other than
    `review`: whichever comes first."""
    async def probe() -> dict | None:
        job = (await stack.http.get(f"/v1/jobs/{job_id}")).json()
        again = [x for x in await _tree_reviews(stack, job_id) if x["requested_at"] != review["requested_at"]]
        return job if job["status"] in ("completed", "failed") else {"asked again": again} if again else None
    return await eventually(probe, what="the agent's end, or a second review")


async def _cli(stack, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        temporal_binary(), *args, "--address", stack.settings.temporal_address,
        # Payloads are encrypted: the CLI encodes its input through the API's codec endpoint.
        "--codec-endpoint", f"{stack.base_url}/codec", "--codec-auth", f"Bearer {stack.keys['operator']}",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, out.decode()
    return out.decode()


def _node_at(tree: dict, depth: int) -> dict:
    node = tree
    while node["depth"] < depth:
        node = node["children"][0]
    return node


async def test_depth_guard_waits_and_cli_approval_continues(stack):
    with stack.llm.scope() as llm:
        llm.script_fn("agent", delegate_until(leaf_depth=4, token=llm.token))
        job_id = await _start(stack, f"Map the harbour records {llm.token}", max_depth=3)
        [review] = await waiting_reviews(stack, job_id)
        assert review["reason"] == "depth" and review["depth"] == 3
        assert review["proposed_action"] == {"action": "delegate", "subgoals": [f"level 4 part {llm.token}"]}
        assert review["job_id"] == f"{job_id}.1.1.1"
        assert (await stack.http.get(f"/v1/jobs/{review['job_id']}")).json()["status"] == "waiting_review"

        async def root_names_its_waiting_child() -> dict | None:  # told up the tree, by signals
            steps = (await stack.http.get(f"/v1/jobs/{job_id}")).json()["steps"]
            step = next((s for s in steps if s["name"] == "delegate 1"), None)
            return step if step and f"{job_id}.1 waits for a person" in (step["detail"] or "") else None

        step = await eventually(root_names_its_waiting_child, what="the root's delegation naming its child")
        assert step["status"] == "running", step

        # Approve with the real `temporal` CLI, as an operator would.
        payload = {"decision": "approve", "reviewer": "cli-operator", "comment": "one more level", "extra_depth": 1}
        await _cli(stack, "workflow", "update", "execute", "-w", review["workflow_id"], "--name", "review",
                   "--input", json.dumps(payload))
        job = await stack.wait_done(job_id, timeout=120)
        plans = llm.calls("agent")
    assert job["status"] == "completed", job
    result = job["result"]
    assert result["status"] == "finished" and result["answer"]
    # Each agent of the chain of five planned: the leaf finished, each parent finished after its child.
    assert _node_at(result["tree"], 4)["answer"] == "answer from depth 4"
    assert result["llm_calls"] == len(plans) == 9
    [decision] = result["decisions"]
    assert decision["reviewer"] == "cli-operator" and decision["decision"] == "approve"
    assert decision["reason"] == "depth" and decision["decided_at"]
    assert await _tree_reviews(stack, job_id) == []


async def test_reject_finishes_with_a_partial_answer(stack):
    with stack.llm.scope() as llm:
        llm.script_fn("agent", delegate_until(leaf_depth=9, token=llm.token))
        job_id = await _start(stack, f"Summarise every ledger {llm.token}", max_depth=1)
        [review] = await waiting_reviews(stack, job_id)
        # A decision naming another review (one decided before: a resent or late request) is refused.
        earlier = (datetime.fromisoformat(review["requested_at"]) - timedelta(seconds=1)).isoformat()
        r = await stack.http.post(f"/v1/jobs/{review['job_id']}/review",
                                  json={"decision": "approve", "reviewer": "ana", "requested_at": earlier})
        assert (r.status_code, r.json()["error"]["code"]) == (409, "not_waiting_for_review"), r.text
        assert "is not the review this job waits on" in r.json()["error"]["message"]
        # The name a reviewer types is theirs to choose; the key that decided is recorded beside it, whatever
        # the body claims.
        r = await stack.http.post(f"/v1/jobs/{review['job_id']}/review",
                                  json={"decision": "reject", "reviewer": "ana", "comment": "deep enough",
                                        "requested_at": review["requested_at"], "key": "acme-operator"})
        assert r.status_code == 200, r.text
        job = await stack.wait_done(job_id)
    stopped = _node_at(job["result"]["tree"], 1)
    assert stopped["status"] == "stopped" and stopped["answer"].startswith("Stopped")
    decided = job["result"]["decisions"][0]
    assert (decided["comment"], decided["reviewer"], decided["key"]) == ("deep enough", "ana", "acme-reviewer")
    again = await stack.http.post(f"/v1/jobs/{review['job_id']}/review",
                                  json={"decision": "approve", "reviewer": "ana"})
    assert again.status_code == 409


async def test_budget_guard_trips_and_waits(stack):
    with stack.llm.scope() as llm:
        llm.script_fn("agent", delegate_until(leaf_depth=9, token=llm.token))
        job_id = await _start(stack, f"Count the ships {llm.token}", max_depth=5, budget={"max_llm_calls": 2})
        [review] = await waiting_reviews(stack, job_id)
        assert review["reason"] == "budget" and review["depth"] == 1
        # The child got only what was left of the shared budget.
        assert "model calls left" in review["detail"] or "budget used up" in review["detail"]
        await stack.http.post(f"/v1/jobs/{review['job_id']}/review", json={"decision": "reject", "reviewer": "bo"})
        # A rejection sticks for the tree: the root finishes with what it has instead of asking again.
        job = await stack.wait_done(job_id)
        assert llm.count("agent") == 2, "the budget allowed two model calls"
    assert job["status"] == "completed" and job["result"]["llm_calls"] == 2
    assert job["result"]["status"] == "stopped" and len(job["result"]["decisions"]) == 1


def always_delegate(token: str):
    """A model that delegates whatever it is asked, one level deeper each time."""
    def plan(body: dict) -> dict:
        subgoal = f"level {plan_depth(body) + 1} part {token}"
        return {"tool_calls": [{"name": "delegate", "arguments": {"subgoal": subgoal}}]}
    return plan


def search_twice_then_finish(answer: str, first_delay: float = 0.0):
    """A model that searches the tide tables, then the lamp schedule, then finishes with `answer`; the plan
    proposing the first search is `first_delay` seconds slow."""
    def plan(body: dict) -> dict:
        observed = body["messages"][-1]["content"].split("OBSERVATIONS SO FAR:\n", 1)[1].split("\n\n", 1)[0]
        searches = observed.count("\n- ") + observed.startswith("- ")
        if searches < 2:
            return {"tool_calls": [{"name": "search_documents", "arguments": {
                "query": ("tide tables", "lamp schedule")[searches]}}], "delay": first_delay if searches == 0 else 0}
        return {"tool_calls": [{"name": "finish", "arguments": {"answer": answer}}]}
    return plan


async def test_a_rejected_delegation_is_not_proposed_again(stack):
    with stack.llm.scope() as llm:
        llm.script_fn("agent", always_delegate(llm.token))
        job_id = await _start(stack, f"Survey the coastline {llm.token}", max_depth=1)
        [first] = await waiting_reviews(stack, job_id)
        assert first["reason"] == "depth" and first["depth"] == 1
        r = await stack.http.post(f"/v1/jobs/{first['job_id']}/review",
                                  json={"decision": "approve", "reviewer": "ann", "extra_depth": 1})
        assert r.status_code == 200, r.text

        async def second_review() -> dict | None:
            return next((x for x in await _tree_reviews(stack, job_id) if x["depth"] == 2), None)

        second = await eventually(second_review, timeout=30, what="a review at depth 2")
        assert second["proposed_action"]["subgoals"] == [f"level 3 part {llm.token}"]
        await stack.http.post(f"/v1/jobs/{second['job_id']}/review", json={"decision": "reject", "reviewer": "ann"})
        # The whole tree finishes with what it has; nobody is asked about the same delegation again.
        job = await stack.wait_done(job_id, timeout=60)
    assert job["status"] == "completed" and job["result"]["status"] == "stopped"
    assert [d["decision"] for d in job["result"]["decisions"]] == ["approve", "reject"]
    assert await _tree_reviews(stack, job_id) == []

    async def tree_listed() -> list[dict]:
        listed = (await stack.http.get("/v1/jobs", params={"kind": "agent", "limit": 1000})).json()["jobs"]
        tree = [j for j in listed if j["job_id"].startswith(job_id)]
        return tree if len(tree) >= 3 and all(j["status"] == "completed" for j in tree) else []

    tree = await eventually(tree_listed, what="the agent tree listed as completed")
    # root, one child, one grandchild: the child did not delegate the rejected branch a second time
    assert sorted(j["job_id"] for j in tree) == [job_id, f"{job_id}.1", f"{job_id}.1.1"]


async def test_a_rejection_stops_the_sub_agents_running_beside_it(stack):
    """Two sub-agents wait for a review each. A reviewer rejects one: the other's review is withdrawn at
    once (nobody is asked about a tree that is stopping), it finishes with what it has, and the root
    finishes too, every call counted. Before, the other waited for its reviewer (up to a day)."""
    with stack.llm.scope() as llm:
        llm.script_fn("agent", two_sub_agents_that_delegate_deeper(llm.token))
        job_id = await _start(stack, f"Survey the piers {llm.token}", max_depth=1)
        reviews = await waiting_reviews(stack, job_id, count=2)
        assert sorted(r["job_id"] for r in reviews) == [f"{job_id}.1", f"{job_id}.2"], reviews
        r = await stack.http.post(f"/v1/jobs/{job_id}.1/review", json={"decision": "reject", "reviewer": "ed"})
        assert r.status_code == 200, r.text
        job = await stack.wait_done(job_id, timeout=60)
        calls = llm.count("agent")
    assert job["status"] == "completed", job
    result = job["result"]
    assert result["status"] == "stopped" and [d["decision"] for d in result["decisions"]] == ["reject"], result
    assert [c["status"] for c in result["tree"]["children"]] == ["stopped", "stopped"], result["tree"]
    assert result["llm_calls"] == calls == 3, result  # the root's plan and each sub-agent's
    assert await _tree_reviews(stack, job_id) == []
    events = [e["type"] for _, e in await read_events(stack, f"{job_id}.2")]
    assert "ragline.review.withdrawn" in events and "ragline.review.decided" not in events, events


async def test_a_sub_agent_a_person_cancels_is_not_delegated_again(stack):
    """A person cancels a sub-agent waiting for its review. Its parent shows the delegation cancelled (not
    failed) and does not propose the same sub-goal again: the model, which would, is told not to."""
    def plan(body: dict) -> dict:  # always delegates: the root, its lighthouse again
        return delegating(f"survey the lighthouse {token}" if plan_depth(body) == 0 else f"deeper {plan_goal(body)}")

    with stack.llm.scope() as llm:
        token = llm.token
        llm.script_fn("agent", plan)
        job_id = await _start(stack, f"Survey the coast {token}", max_depth=1)
        [review] = await waiting_reviews(stack, job_id)
        assert review["job_id"] == f"{job_id}.1"
        r = await stack.http.post(f"/v1/jobs/{job_id}.1/cancel")
        assert r.status_code == 202, r.text
        job = await stack.wait_done(job_id, timeout=60)
    assert job["status"] == "completed", job
    steps = {s["name"]: s for s in job["steps"]}
    assert steps["delegate 1"]["status"] == "cancelled" and "delegate 2" not in steps, steps
    assert steps["delegate 1"]["detail"] == f"survey the lighthouse {token}", steps  # no longer "waits for"
    assert [c["status"] for c in job["result"]["tree"]["children"]] == ["cancelled"], job["result"]["tree"]


async def test_a_sub_agent_cancelled_deep_in_the_tree_stops_nothing_above_it(stack):
    """A person cancels a grandchild waiting for its review: its parent plans on without it and finishes,
    and so does the root. A cancel is not a reviewer's rejection, which stops the whole tree."""
    with stack.llm.scope() as llm:
        llm.script_fn("agent", delegate_until(leaf_depth=3, token=llm.token))
        job_id = await _start(stack, f"Chart the reefs {llm.token}", max_depth=2)
        [review] = await waiting_reviews(stack, job_id)
        assert review["job_id"] == f"{job_id}.1.1", review
        r = await stack.http.post(f"/v1/jobs/{job_id}.1.1/cancel")
        assert r.status_code == 202, r.text
        job = await stack.wait_done(job_id, timeout=60)
    assert job["status"] == "completed", job
    result = job["result"]
    assert (result["status"], result["answer"], result["decisions"]) == ("finished", "answer from depth 0", []), result
    [child] = result["tree"]["children"]
    assert (child["status"], [g["status"] for g in child["children"]]) == ("finished", ["cancelled"]), child


async def test_a_sub_goal_already_answered_is_not_delegated_again(stack):
    """A small model proposes the sub-goal a sub-agent already answered, round after round: it is told so
    once, and no second sub-agent runs (each cost a sub-agent and its calls, until the budget ran out). The
    answer it stops with is what was found, not what it was told."""
    def plan(body: dict) -> dict:
        if plan_depth(body) == 0:
            return delegating(f"count the boats {token}")
        return {"tool_calls": [{"name": "finish", "arguments": {"answer": "twelve boats"}}]}

    with stack.llm.scope() as llm:
        token = llm.token
        llm.script_fn("agent", plan)
        job_id = await _start(stack, f"Survey the harbour {token}", max_depth=1)
        job = await stack.wait_done(job_id, timeout=60)
    assert job["status"] == "completed", job
    result = job["result"]
    assert [c["answer"] for c in result["tree"]["children"]] == ["twelve boats"], result["tree"]
    assert result["llm_calls"] == MAX_TURNS + 1, result  # the root's rounds, and the one sub-agent's plan
    assert "twelve boats" in result["answer"] and "do not delegate" not in result["answer"], result["answer"]


async def test_loop_guard_trips_on_a_repeated_goal(stack):
    def loop(body: dict) -> dict:
        if fresh_plan(body):
            return {"tool_calls": [{"name": "delegate", "arguments": {"subgoal": plan_goal(body).upper() + "!"}}]}
        return {"tool_calls": [{"name": "finish", "arguments": {"answer": "done"}}]}

    # Upper case: the token survives the model's shouting the goal back.
    with stack.llm.scope(f"TOK{uuid.uuid4().hex[:10].upper()}") as llm:
        llm.script_fn("agent", loop)
        job_id = await _start(stack, f"Find the lighthouse keeper {llm.token}")
        [review] = await waiting_reviews(stack, job_id)
        assert review["reason"] == "loop" and review["depth"] == 0 and review["job_id"] == job_id
        # A revise decision continues with the reviewer's instructions instead of the delegation.
        r = await stack.http.post(f"/v1/jobs/{job_id}/review", json={
            "decision": "revise", "reviewer": "cy", "instructions": "search the documents yourself"})
        assert r.status_code == 200
        job = await stack.wait_done(job_id)
        plans = llm.calls("agent")
    assert job["status"] == "completed" and job["result"]["answer"] == "done"
    assert len(plans) == 2 and "search the documents yourself" in plans[-1].user_message
    assert job["result"]["tree"]["children"] == []


async def test_a_stopped_agents_answer_is_what_it_found_not_what_a_reviewer_told_it(stack):
    """A reviewer's revise ("search the documents yourself") is told to the model; the walkthrough's agent,
    rejected later, answered it as "What was found:"."""
    def loop(body: dict) -> dict:
        return {"tool_calls": [{"name": "delegate", "arguments": {"subgoal": plan_goal(body).upper() + "!"}}]}

    with stack.llm.scope(f"TOK{uuid.uuid4().hex[:10].upper()}") as llm:
        llm.script_fn("agent", loop)
        job_id = await _start(stack, f"Find the lighthouse keeper {llm.token}")
        await waiting_reviews(stack, job_id)
        r = await stack.http.post(f"/v1/jobs/{job_id}/review", json={
            "decision": "revise", "reviewer": "cy", "instructions": "search the documents yourself"})
        assert r.status_code == 200
        await llm.wait_for_calls(2, "agent")  # it delegated its own goal again: a second review
        await waiting_reviews(stack, job_id)
        r = await stack.http.post(f"/v1/jobs/{job_id}/review", json={"decision": "reject", "reviewer": "cy"})
        assert r.status_code == 200
        job = await stack.wait_done(job_id)
    assert "search the documents yourself" in llm.calls("agent")[-1].user_message
    assert job["result"]["answer"] == "Stopped before finding an answer.", job["result"]


async def test_a_revise_on_a_spent_budget_brings_its_extra_budget(stack):
    """A reviewer tells an agent that spent its budget what to do instead, and gives it two more model calls
    for that: the agent uses them (it searched once more, then finished). Before, a revise dropped its
    extension: the agent planned one call over its budget and asked for a review again."""
    with stack.llm.scope() as llm:
        llm.script_fn("agent", search_twice_then_finish("the lamps follow the tides"))
        job_id = await _start(stack, f"Relate the lamps to the tides {llm.token}",
                              budget={"max_llm_calls": 1, "max_tokens": 100000, "max_seconds": 600})
        [review] = await waiting_reviews(stack, job_id)
        assert review["reason"] == "budget"
        r = await stack.http.post(f"/v1/jobs/{job_id}/review", json={
            "decision": "revise", "reviewer": "cy", "instructions": "search the lamp schedule, then finish",
            "extra_budget": {"max_llm_calls": 2}})
        assert r.status_code == 200
        job = await stack.wait_done(job_id)
    assert job["status"] == "completed", job
    result = job["result"]
    assert (result["status"], result["answer"], result["llm_calls"]) == ("finished", "the lamps follow the tides", 3)
    [decision] = result["decisions"]
    assert json.dumps(decision["extra_budget"]) == '{"max_llm_calls": 2}'  # a count, as sent (it read 2.0)


async def test_seconds_granted_on_a_spent_time_budget_count_from_the_decision(stack):
    """An agent out of time waits for a review; the reviewer, some seconds later, grants 2 s more: the agent
    searches once more and finishes. Before, the seconds were added to the deadline that had passed, so the
    wait for the person ate them: after the one plan the decision let through, the agent asked again ("time
    budget used up"), whatever a reviewer granted short of the time the review had waited (24 h at most); a
    sub-agent it delegated to was out of time from its start."""
    with stack.llm.scope() as llm:
        # The first plan slow enough that the second finds the 1 s budget spent.
        llm.script_fn("agent", search_twice_then_finish("the lamps follow the tides", first_delay=1.5))
        job_id = await _start(stack, f"Relate the lamps to the tides {llm.token}",
                              budget={"max_llm_calls": 10, "max_tokens": 100000, "max_seconds": 1})
        [review] = await waiting_reviews(stack, job_id)
        assert review["reason"] == "budget" and "time budget used up" in review["detail"], review
        # The person takes longer to decide than the seconds they grant (as anyone does who grants a minute
        # after an hour): the review has waited 3 s past its request when the 2 s come.
        await until_waited(review, 3)
        r = await stack.http.post(f"/v1/jobs/{job_id}/review", json={
            "decision": "approve", "reviewer": "ed", "extra_budget": {"max_seconds": 2},
            "requested_at": review["requested_at"]})
        assert r.status_code == 200, r.text
        job = await _ended_or_asked_again(stack, job_id, review)
    assert job.get("status") == "completed", job
    result = job["result"]
    assert (result["status"], result["answer"], result["llm_calls"]) == ("finished", "the lamps follow the tides", 3)
    assert len(result["decisions"]) == 1
    # What the result calls granted is how far the deadline moved (README): the 2 s and the 3 s waited past it.
    assert result["granted"]["seconds"] > 2 + 3, result["granted"]



async def test_the_wait_for_a_reviewer_is_not_charged_to_the_agents_time(stack):
    """An agent past its max_depth asks to delegate; the reviewer approves one more level after its whole
    time budget has gone by in the wait. The sub-agent runs and the agent finishes on the time it had left.
    Before, the wait was charged: the sub-agent started out of time and asked for a review of its own
    ("time budget used up"), and the reviewer had to decide twice."""
    def plan(body: dict) -> dict:
        if plan_depth(body) == 0 and fresh_plan(body):
            return delegating(f"count the boats {token}")
        return {"tool_calls": [{"name": "finish", "arguments": {"answer": "twelve boats"}}]}

    with stack.llm.scope() as llm:
        token = llm.token
        llm.script_fn("agent", plan)
        job_id = await _start(stack, f"Survey the harbour {token}", max_depth=0,
                              budget={"max_llm_calls": 10, "max_tokens": 100000, "max_seconds": 4})
        [review] = await waiting_reviews(stack, job_id)
        assert review["reason"] == "depth", review
        await until_waited(review, 5)  # past the 4 s budget
        r = await stack.http.post(f"/v1/jobs/{job_id}/review", json={
            "decision": "approve", "reviewer": "ed", "extra_depth": 1, "requested_at": review["requested_at"]})
        assert r.status_code == 200, r.text
        job = await _ended_or_asked_again(stack, job_id, review)
    assert job.get("status") == "completed", job
    result = job["result"]
    assert (result["status"], result["answer"]) == ("finished", "twelve boats"), result
    assert [c["answer"] for c in result["tree"]["children"]] == ["twelve boats"], result["tree"]
    assert len(result["decisions"]) == 1


async def test_an_extension_granted_below_extends_the_ancestors_budget_too(stack):
    """The root (3 model calls) hands its sub-agent the 2 it has left after its first plan; the sub-agent
    searches twice, asks for more and is granted 2, and finishes. The root, which pays for the 3 calls
    below it, plans its answer without asking a reviewer again: the extension was granted for that spend.
    Before, each ancestor's budget guard tripped in turn (4 of 3)."""
    sub_agent = search_twice_then_finish("twelve lamps")

    def plan(body: dict) -> dict:
        if plan_depth(body) > 0:
            return sub_agent(body)
        if fresh_plan(body):
            return {"tool_calls": [{"name": "delegate", "arguments": {"subgoal": f"count the lamps {token}"}}]}
        return {"tool_calls": [{"name": "finish", "arguments": {"answer": "the root's answer"}}]}

    with stack.llm.scope() as llm:
        token = llm.token
        llm.script_fn("agent", plan)
        job_id = await _start(stack, f"Survey the harbour {token}", max_depth=2,
                              budget={"max_llm_calls": 3, "max_tokens": 100000, "max_seconds": 600})
        [review] = await waiting_reviews(stack, job_id)
        assert (review["reason"], review["depth"]) == ("budget", 1), review
        r = await stack.http.post(f"/v1/jobs/{review['job_id']}/review", json={
            "decision": "approve", "reviewer": "di", "extra_budget": {"max_llm_calls": 2}})
        assert r.status_code == 200, r.text
        job = await stack.wait_done(job_id)
        asked = [d["depth"] for d in job["result"]["decisions"]] if job["status"] == "completed" else None
    assert job["status"] == "completed", job
    result = job["result"]
    assert (result["status"], result["answer"], result["llm_calls"]) == ("finished", "the root's answer", 5), result
    assert asked == [1], job["result"]["decisions"]


async def test_signal_reviews_record_bad_input_and_accept_good_input(stack):
    with stack.llm.scope() as llm:
        llm.script_fn("agent", delegate_until(leaf_depth=9, token=llm.token))
        job_id = await _start(stack, f"Read the tide tables {llm.token}", max_depth=0)
        await waiting_reviews(stack, job_id)
        await _cli(stack, "workflow", "signal", "-w", job_id, "--name", "review",
                   "--input", json.dumps({"decision": "maybe", "reviewer": "dee"}))

        async def rejected_inputs() -> list[dict]:
            reviews = await _tree_reviews(stack, job_id)
            return reviews[0]["rejected_inputs"] if reviews else []

        [rejected] = await eventually(rejected_inputs, timeout=10, what="the bad signal recorded")
        assert "decision" in rejected["error"]
        # An extension beyond what one review may grant is bad input too, not an agent a billion levels deep.
        await _cli(stack, "workflow", "signal", "-w", job_id, "--name", "review",
                   "--input", json.dumps({"decision": "approve", "reviewer": "dee", "extra_depth": 10**9}))
        _, too_deep = await eventually(lambda: _at_least(2, rejected_inputs), timeout=10, what="2 bad signals")
        assert "extra_depth" in too_deep["error"]
        # Through the API the same is refused at once, with what is wrong: an infinite budget (1e400 is
        # valid JSON), an unknown budget key, a blank reviewer.
        for body, code in ((b'{"decision": "approve", "reviewer": "x", "extra_budget": {"max_tokens": 1e400}}',
                            "invalid_request"),
                           (b'{"decision": "approve", "reviewer": "x", "extra_budget": {"max_pages": 1}}',
                            "invalid_review"),
                           (b'{"decision": "approve", "reviewer": " "}', "invalid_review")):
            r = await stack.http.post(f"/v1/jobs/{job_id}/review", content=body,
                                      headers={"content-type": "application/json"})
            assert (r.status_code, r.json()["error"]["code"]) == (422, code), body
        # The bad input left the agent waiting.
        assert (await stack.http.get(f"/v1/jobs/{job_id}")).json()["status"] == "waiting_review"
        await _cli(stack, "workflow", "signal", "-w", job_id, "--name", "review",
                   "--input", json.dumps({"decision": "reject", "reviewer": "dee"}))
        job = await stack.wait_done(job_id)
    assert job["status"] == "completed" and job["result"]["status"] == "stopped"
    assert job["result"]["decisions"][0]["reviewer"] == "dee"


async def _at_least(n: int, probe) -> list | None:
    found = await probe()
    return found if len(found) >= n else None


async def test_bad_tool_calls_are_tool_errors_and_events_carry_depth(stack):
    with stack.llm.scope() as llm:
        llm.script("agent", [{"tool_calls": [{"name": "rm_rf", "arguments": {"path": "/"}}]},
                             {"tool_calls": [{"name": "search_documents", "arguments": {"q": "x"}}]},
                             {"tool_calls": [{"name": "finish", "arguments": {"answer": "safe"}}]}])
        job_id = await _start(stack, f"Try something odd {llm.token}")
        job = await stack.wait_done(job_id)
        plans = llm.calls("agent")
    assert job["status"] == "completed" and job["result"]["answer"] == "safe"
    assert len(plans) == 3 and job["result"]["llm_calls"] == 3
    assert "unknown tool 'rm_rf'" in plans[1].user_message
    assert "search_documents needs a non-empty string 'query'" in plans[2].user_message

    events = await read_events(stack, job_id)
    assert events
    assert all(e["data"].get("depth") == 0 for _, e in events)


async def test_tool_calls_a_model_writes_as_its_text_are_run(stack):
    """llama.cpp's server (the offline default) hands back a Qwen model's tool calls as the reply's text:
    a bare JSON call, or one in <tool_call> tags. They are run as calls, not taken for the answer."""
    with stack.llm.scope() as llm:
        llm.script("agent", [json.dumps({"name": "compare", "arguments": {"a": 1}}),
                             json.dumps({"name": "search_documents", "arguments": {"query": "tide tables"}}),
                             '<tool_call>\n{"name": "finish", "arguments": {"answer": "High tide at noon."}}\n</tool_call>'])
        job_id = await _start(stack, f"When is high tide? {llm.token}")
        job = await stack.wait_done(job_id)
        plans = llm.calls("agent")
    assert job["status"] == "completed" and job["result"]["answer"] == "High tide at noon."
    assert len(plans) == 3
    assert "unknown tool 'compare'" in plans[1].user_message  # an invented tool is a tool error, not an answer
    assert [s["name"] for s in job["steps"]] == ["plan 1", "plan 2", "search 2", "plan 3"]
    # The job's view says what went wrong in a plan, not only that it completed.
    assert "tool error: unknown tool 'compare'" in job["steps"][0]["detail"]
    assert "search_documents('tide tables')" in plans[2].user_message  # the search's outcome went back


async def test_a_plan_the_model_keeps_failing_shows_its_attempts_and_error_while_it_retries(stack):
    """`plan 1` runs the activity agent_plan: the server's view of that retrying activity is the step's (its
    attempts and last error), as a step named after its activity shows it. It showed `running`, 0 attempts."""
    with stack.llm.scope() as llm:
        llm.script("agent", ["503", "503", {"content": "High tide at Vell is at noon.", "delay": 2}])
        job_id = await _start(stack, f"When is high tide? {llm.token}")

        async def retrying() -> dict | None:
            job = (await stack.http.get(f"/v1/jobs/{job_id}")).json()
            plan = next((s for s in job["steps"] if s["name"] == "plan 1"), None)
            return plan if plan and plan["attempts"] >= 2 and "503" in (plan["error"] or "") else None
        plan = await eventually(retrying, timeout=30, what="plan 1 showing its failed attempts")
        assert plan["status"] in ("running", "waiting") and plan["activity"] == "agent_plan", plan
        job = await stack.wait_done(job_id)
    assert job["status"] == "completed" and job["steps"][0]["attempts"] == 3, job["steps"]


async def test_a_malformed_tool_call_is_no_answer_the_agent_plans_again(stack):
    """A small model writes a call as broken JSON in a fence: not the answer, but one more plan, told why."""
    broken = '```json\n{"name": "finish", "arguments": {"answer": "High tide at noon."}\n```'
    with stack.llm.scope() as llm:
        llm.script("agent", [broken, "High tide at Vell is at noon."])
        job_id = await _start(stack, f"When is high tide? {llm.token}")
        job = await stack.wait_done(job_id)
        plans = llm.calls("agent")
    assert job["status"] == "completed" and job["result"]["answer"] == "High tide at Vell is at noon."
    assert [s["name"] for s in job["steps"]] == ["plan 1", "plan 2"]
    assert job["steps"][0]["detail"].startswith("malformed tool call: the tool call was not valid JSON")
    assert len(plans) == 2 and job["result"]["llm_calls"] == 2  # the re-plan is a model call of the budget
    assert "not a valid tool call: the tool call was not valid JSON" in plans[1].user_message


async def test_a_malformed_tool_call_in_the_last_round_still_gets_its_correction(stack):
    """The rounds ran out with a correction due: it gets one round more, not the answer "rounds ran out"."""
    search = {"tool_calls": [{"name": "search_documents", "arguments": {"query": "tides"}}]}
    broken = '{"name": "finish", "arguments": {"answer": "noon"}'
    with stack.llm.scope() as llm:
        llm.script("agent", [search] * (MAX_TURNS - 1) + [broken, "High tide at Vell is at noon."])
        job_id = await _start(stack, f"When exactly is high tide? {llm.token}")
        job = await stack.wait_done(job_id)
        assert llm.count("agent") == MAX_TURNS + 1
    assert job["status"] == "completed" and job["result"]["answer"] == "High tide at Vell is at noon."
    plans = [s["name"] for s in job["steps"] if s["name"].startswith("plan")]
    assert plans == [f"plan {n}" for n in range(1, MAX_TURNS + 2)]


async def test_a_tool_call_malformed_again_fails_the_job_with_the_reason(stack):
    with stack.llm.scope() as llm:
        llm.script("agent", ['{"tool": "lookup", "arguments": {"q": "tides"}}'] * 2)
        job_id = await _start(stack, f"When is low tide? {llm.token}")
        job = await stack.wait_done(job_id)
        assert llm.count("agent") == 2, "one corrective re-plan, not retried"
    assert job["status"] == "failed"
    assert "unknown tool 'lookup'" in job["error"]["message"]
    assert [(s["name"], s["status"]) for s in job["steps"]] == [("plan 1", "completed"), ("plan 2", "failed")]


async def test_limits_above_the_ceiling_are_refused(stack):
    r = await stack.http.post("/v1/agents", json={"goal": "x", "max_depth": 99})
    assert r.status_code == 422 and "max_depth" in r.json()["error"]["message"]
    r = await stack.http.post("/v1/agents", json={"goal": "x", "budget": {"max_llm_calls": 10**6}})
    assert r.status_code == 422
    # Past what a float holds: still the ceiling's 422, with the number as sent.
    r = await stack.http.post("/v1/agents", json={"goal": "x", "budget": {"max_tokens": 10**400}})
    assert (r.status_code, r.json()["error"]["code"]) == (422, "over_ceiling"), r.text
    assert f"budget.max_tokens {10**400} >" in r.json()["error"]["message"]


async def test_a_goal_longer_than_the_models_context_can_plan_from_is_refused_at_once(stack):
    """The walkthrough's agent with a goal of 3,420 CJK characters was accepted, and failed on its first plan:
    the model's context was exceeded (its prompt shows the goal twice). It is refused at the door, naming
    the bound; a goal within it starts."""
    goal = "请总结差旅报销制度" * 380
    r = await stack.http.post("/v1/agents", json={"goal": goal})
    assert (r.status_code, r.json()["error"]["code"]) == (422, "goal_too_long"), r.text
    assert "about 3420 tokens" in r.json()["error"]["message"] and r.json()["error"]["field"] == "goal"
    most = question_budget(stack.settings) // 2
    r = await stack.http.post("/v1/agents", json={"goal": "请" * most, "max_depth": 0})
    assert r.status_code == 202, r.text
    await stack.client.get_workflow_handle(r.json()["job_id"]).terminate("test over")


async def test_chat_with_require_review_releases_the_answer_only_after_approval(stack):
    seed = await stack.upload(("tides.txt", b"High tide at Vell harbour is at noon. Low tide follows at six."),
                              collection="reviewed")
    await stack.wait_job(seed["job_id"])
    with stack.llm.scope() as llm:
        r = await stack.http.post("/v1/chats", json={"message": f"When is high tide at Vell? {llm.token}",
                                                     "collection": "reviewed", "require_review": True})
        job_id = r.json()["job_id"]
        [review] = await waiting_reviews(stack, job_id)
        [answer_call] = llm.calls("answer")
    assert review["job_id"] == job_id and review["reason"] == "review requested"
    # The reviewer sees the answer the model gave, held back from the user; a member key sees that it waits.
    model_answer = answer_call.reply.strip()
    passages = [{"n": 1, "filename": "tides.txt", "page": 1,
                 "opening": "High tide at Vell harbour is at noon. Low tide follows at six."}]
    assert review["proposed_action"] == {"action": "release_answer", "answer": model_answer, "passages": passages}
    members_view = [r for r in (await stack.member_http.get("/v1/reviews")).json()["reviews"] if r["job_id"] == job_id]
    assert [(r["proposed_action"], r["withheld"]) for r in members_view] == \
        [({"action": "release_answer", "passages": passages}, ["answer"])]
    held = (await stack.http.get(f"/v1/jobs/{job_id}")).json()
    assert held["status"] == "waiting_review" and held["result"] is None
    session = (await stack.http.get(f"/v1/chats/{r.json()['session_id']}")).json()
    assert session["turns"][0]["answer"] is None

    # A chat answer is revised by giving the text to release: `revise` alone would release it unchanged.
    r = await stack.http.post(f"/v1/jobs/{job_id}/review", json={"decision": "revise", "reviewer": "editor"})
    assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_review")
    await stack.http.post(f"/v1/jobs/{job_id}/review", json={
        "decision": "revise", "reviewer": "editor", "answer": "High tide is at noon [1]."})
    job = await stack.wait_done(job_id)
    assert job["status"] == "completed"
    assert job["result"]["answer"] == "High tide is at noon [1]."
    assert job["result"]["review"]["reviewer"] == "editor"
    # The text the reviewer replaced stays on record for reviewers, and only for them.
    assert job["result"]["review"]["proposed_action"]["answer"] == model_answer
    as_member = (await stack.member_http.get(f"/v1/jobs/{job_id}")).json()
    assert as_member["result"]["answer"] == "High tide is at noon [1]." and model_answer not in json.dumps(as_member)
    assert as_member["result"]["review"]["withheld"] == ["answer"]
    # The event stream showed nothing of the held answer: no deltas, and the answer only as released.
    events = await read_events(stack, job_id)
    assert model_answer not in json.dumps(events, ensure_ascii=False)
    types = [(e["type"], e["data"]) for _, e in events]
    assert not [t for t, _ in types if t == "ragline.answer.delta"]
    [(index, shown)] = [(i, d) for i, (t, d) in enumerate(types) if t == "ragline.answer.completed"]
    assert shown["answer"] == "High tide is at noon [1]."
    assert index > [t for t, _ in types].index("ragline.review.decided")


TIDES = ("harbour-tides.txt", b"High tide at Vell harbour is at noon.")
LAMPS = ("harbour-lamps.txt", b"The harbour lamps of Vell are lit at dusk by the keeper.")


def passage_number(user_message: str, filename: str) -> int:
    """The [n] the answer prompt gave the passage of `filename` (numbers follow the retrieval's ranking)."""
    passages, _ = parse_prompt(user_message)
    [number] = [p.number for p in passages if p.source.startswith(filename)]
    return number


async def _held_answer(stack, llm, question: str, collection: str) -> tuple[str, str]:
    """A turn whose answer waits for a reviewer: its job id and the answer prompt the model saw."""
    r = await stack.http.post("/v1/chats", json={"message": f"{question} {llm.token}", "collection": collection,
                                                 "require_review": True})
    job_id = r.json()["job_id"]
    await waiting_reviews(stack, job_id)
    [answer_call] = llm.calls("answer")
    return job_id, answer_call.user_message


async def test_a_reviewers_malformed_revision_of_a_held_answer_stays_with_reviewers(stack):
    """A revision sent as a signal that fails validation is recorded for the reviewers to see what went
    wrong; its text (the answer to be released) is, like the held answer, not for member keys."""
    seed = await stack.upload(TIDES, collection="reviewed-bad-signal")
    await stack.wait_job(seed["job_id"])
    with stack.llm.scope() as llm:
        job_id, _ = await _held_answer(stack, llm, "When is high tide at Vell?", "reviewed-bad-signal")
    secret = "High tide at Vell is at noon, says the harbour master [1]."
    await _cli(stack, "workflow", "signal", "-w", job_id, "--name", "review", "--input",
               json.dumps({"decision": "revise", "reviewer": "dee", "answer": secret, "extra_depth": -1}))

    async def rejected(http) -> list[dict]:  # noqa: ANN001
        reviews = [r for r in (await http.get("/v1/reviews")).json()["reviews"] if r["job_id"] == job_id]
        return reviews[0]["rejected_inputs"] if reviews else []
    [as_reviewer] = await eventually(lambda: rejected(stack.http), timeout=10, what="the bad signal recorded")
    assert as_reviewer["payload"]["answer"] == secret and "extra_depth" in as_reviewer["error"]
    [as_member] = await rejected(stack.member_http)
    assert "answer" not in as_member["payload"] and as_member["payload"]["reviewer"] == "dee"
    r = await stack.http.post(f"/v1/jobs/{job_id}/review", json={"decision": "approve", "reviewer": "dee"})
    assert r.status_code == 200, r.text
    await stack.wait_done(job_id)
    events = await read_events(stack, job_id)  # what every key of the tenant reads
    assert [e for _, e in events if e["type"] == "ragline.review.rejected_input"]
    assert secret not in json.dumps(events, ensure_ascii=False)


async def test_a_held_answers_revision_sent_as_a_json_string_stays_with_reviewers(stack):
    """A revision quoted once too often (`--input '"{\\"decision\\": ...}"'`) reaches the job as a string, not an
    object: no key can be left out of it, so a member key reads none of it, in the review and in the events."""
    seed = await stack.upload(TIDES, collection="reviewed-string-signal")
    await stack.wait_job(seed["job_id"])
    with stack.llm.scope() as llm:
        job_id, _ = await _held_answer(stack, llm, "When is high tide at Vell?", "reviewed-string-signal")
    secret = "High tide at Vell is at noon, says the harbour master [1]."
    await _cli(stack, "workflow", "signal", "-w", job_id, "--name", "review", "--input",
               json.dumps(json.dumps({"decision": "revise", "reviewer": "dee", "answer": secret})))

    async def rejected(http) -> list[dict]:  # noqa: ANN001
        reviews = [r for r in (await http.get("/v1/reviews")).json()["reviews"] if r["job_id"] == job_id]
        return reviews[0]["rejected_inputs"] if reviews else []
    [as_reviewer] = await eventually(lambda: rejected(stack.http), timeout=10, what="the bad signal recorded")
    assert secret in as_reviewer["payload"]
    [as_member] = await rejected(stack.member_http)
    assert secret not in json.dumps(as_member) and as_member["error"] == as_reviewer["error"]
    r = await stack.http.post(f"/v1/jobs/{job_id}/review", json={"decision": "approve", "reviewer": "dee"})
    assert r.status_code == 200, r.text
    await stack.wait_done(job_id)
    events = await read_events(stack, job_id)  # what every key of the tenant reads
    assert [e for _, e in events if e["type"] == "ragline.review.rejected_input"]
    assert secret not in json.dumps(events, ensure_ascii=False)


async def test_two_reviewers_deciding_at_once_get_one_decision_taken_and_one_refused(stack):
    """Two decisions sent at the same moment may reach the job in one workflow task: the first is taken,
    the second refused (409), never both acknowledged with one silently dropped."""
    seed = await stack.upload(TIDES, collection="reviewed-twice")
    await stack.wait_job(seed["job_id"])
    with stack.llm.scope() as llm:
        job_id, _ = await _held_answer(stack, llm, "When is high tide at Vell?", "reviewed-twice")
    decisions = [{"decision": "approve", "reviewer": "ana"}, {"decision": "reject", "reviewer": "ben"}]
    answers = await asyncio.gather(*(stack.http.post(f"/v1/jobs/{job_id}/review", json=d) for d in decisions))
    codes = sorted(r.status_code for r in answers)
    assert codes == [200, 409], [r.text for r in answers]
    [taken] = [d for d, r in zip(decisions, answers) if r.status_code == 200]
    [refused] = [r for r in answers if r.status_code == 409]
    # (refused by the job, or by Temporal when the job has ended with the first decision)
    assert refused.json()["error"]["code"] in ("not_waiting_for_review", "job_closed"), refused.text
    job = await stack.wait_done(job_id)
    assert job["status"] == ("completed" if taken["decision"] == "approve" else "failed"), job
    decided = [e["data"] for _, e in await read_events(stack, job_id) if e["type"] == "ragline.review.decided"]
    assert [(d["decision"], d["reviewer"]) for d in decided] == [(taken["decision"], taken["reviewer"])]


async def test_a_reviewers_answer_is_released_with_its_own_citations_not_the_models(stack):
    """The model cites the tide passage; the reviewer writes about the lamps and cites theirs. The turn shows
    the reviewer's text with the lamp passage, not the model's citation of a text nobody sees."""
    seed = await stack.upload(TIDES, LAMPS, collection="replaced")
    await stack.wait_job(seed["job_id"])
    with stack.llm.scope() as llm:
        llm.script_fn("answer", lambda body: "High tide at Vell harbour is at noon "
                      f"[{passage_number(body['messages'][-1]['content'], TIDES[0])}].")
        job_id, prompt = await _held_answer(stack, llm, "When is high tide at Vell harbour?", "replaced")
    model_answer = f"High tide at Vell harbour is at noon [{passage_number(prompt, TIDES[0])}]."
    replacement = f"The harbour lamps are lit at dusk [{passage_number(prompt, LAMPS[0])}]."
    # The review shows the passages numbered as the model saw them: what the reviewer's [n] will name.
    [held] = [r for r in (await stack.http.get("/v1/reviews")).json()["reviews"] if r["job_id"] == job_id]
    numbered = {p["filename"]: p["n"] for p in held["proposed_action"]["passages"]}
    assert numbered == {f: passage_number(prompt, f) for f in (TIDES[0], LAMPS[0])}
    await stack.http.post(f"/v1/jobs/{job_id}/review", json={"decision": "revise", "reviewer": "editor",
                                                            "answer": replacement})
    job = await stack.wait_done(job_id)
    result = job["result"]
    assert result["answer"] == replacement
    assert [(c["filename"], c["quote"]) for c in result["citations"]] == [(LAMPS[0], LAMPS[1].decode())]
    assert result["supported"] is True and result["written_by_reviewer"] is True
    # The model's answer stays on record, for reviewers only.
    assert result["review"]["proposed_action"]["answer"] == model_answer
    as_member = (await stack.member_http.get(f"/v1/jobs/{job_id}")).json()
    assert model_answer not in json.dumps(as_member) and as_member["result"]["citations"] == result["citations"]
    # The event a watching person gets says the same.
    [shown] = [e["data"] for _, e in await read_events(stack, job_id) if e["type"] == "ragline.answer.completed"]
    assert (shown["answer"], shown["citations"], shown["written_by_reviewer"]) == \
        (replacement, result["citations"], True)
    # So does the session's list of turns.
    [turn] = await session_turns(stack.http, result["session_id"], job_id)
    assert (turn["answer"], [c["filename"] for c in turn["citations"]], turn["written_by_reviewer"]) == \
        (replacement, [LAMPS[0]], True)


async def test_a_reviewers_answer_without_markers_cites_nothing_and_drops_the_models_warnings(stack):
    """What the turn told about the model's answer ("unverified") is not said of the reviewer's text; a text
    without [n] markers is not backed by a passage (`supported: false`)."""
    seed = await stack.upload(TIDES, collection="replaced-uncited")
    await stack.wait_job(seed["job_id"])
    with stack.llm.scope() as llm:
        llm.script("answer", ["Nobody could possibly know that."])
        job_id, _ = await _held_answer(stack, llm, "When is high tide at Vell harbour?", "replaced-uncited")
    held = [r for r in (await stack.http.get("/v1/reviews")).json()["reviews"] if r["job_id"] == job_id]
    assert held[0]["proposed_action"]["answer"] == "Nobody could possibly know that."
    await stack.http.post(f"/v1/jobs/{job_id}/review", json={"decision": "approve", "reviewer": "editor",
                                                            "answer": "At noon."})
    result = (await stack.wait_done(job_id))["result"]
    assert (result["answer"], result["citations"], result["supported"]) == ("At noon.", [], False)
    assert not [w for w in result["warnings"] if "unverified" in w]
    assert result["written_by_reviewer"] is True


async def test_unsupported_answers_are_held_when_configured(temporal_env, scripted_llm, tmp_path):
    address = temporal_env.client.service_client.config.target_host
    async with running_stack(address, scripted_llm, tmp_path, task_queue="ragline-unsupported",
                             review_unsupported_answers=True) as stack:
        seed = await stack.upload(("birds.txt", b"Puffins nest on the cliffs of Vell every spring."),
                                  collection="birds")
        await stack.wait_job(seed["job_id"])
        with scripted_llm.scope() as llm:
            llm.script("answer", ["Puffins nest on the cliffs [1]."])
            # Its summary and entities hang: an answer that cites a passage is shown without them.
            llm.script_fn("summarize", lambda request: {"content": "[]", "delay": 60})
            llm.script_fn("extract_entities", lambda request: {"content": "[]", "delay": 60})
            supported = await stack.chat(f"Where do puffins nest? {llm.token}", collection="birds")

            async def shown() -> dict | None:
                job = (await stack.http.get(f"/v1/jobs/{supported['job_id']}")).json()
                return job if job.get("answer") else None
            released = await eventually(shown, timeout=30, what="the supported answer, shown")
            await stack.http.post(f"/v1/jobs/{supported['job_id']}/cancel")
        assert released["result"] is None and released["status"] != "waiting_review"  # cites a passage: released
        assert released["answer"]["answer"] == "Puffins nest on the cliffs [1]."
        assert [c["filename"] for c in released["answer"]["citations"]] == ["birds.txt"]
        assert (await stack.wait_done(supported["job_id"]))["status"] == "cancelled"

        with scripted_llm.scope() as llm:
            llm.script("answer", ["Probably somewhere warm, I would guess."])
            held = await stack.chat(f"Where do swallows go in winter? {llm.token}", collection="birds")
            job = await stack.wait_job(held["job_id"])
        assert job["status"] == "waiting_review"
        [review] = await waiting_reviews(stack, held["job_id"])
        assert review["reason"] == "answer without a supporting citation"
        assert review["proposed_action"]["answer"] == "Probably somewhere warm, I would guess."
        await stack.http.post(f"/v1/jobs/{held['job_id']}/review", json={"decision": "reject", "reviewer": "ed",
                                                                         "comment": "unsupported"})
        job = await stack.wait_done(held["job_id"])
        assert job["status"] == "failed" and "answer rejected by ed: unsupported" in job["error"]["message"]

        # An evaluation's answers are the model's, reviewed by nobody: a member key reads how right they were,
        # not what they say.
        with scripted_llm.scope() as llm:
            llm.script_fn("answer", lambda request: "Probably somewhere warm, I would guess.")
            golden = json.dumps({"question": f"Where do puffins nest in spring? {llm.token}",
                                 "expected_document": "birds.txt", "expected_answer": "the cliffs"})
            r = await stack.member_http.post("/v1/evaluations?collection=birds&answers=true", content=golden.encode())
            assert r.status_code == 202, r.text
            evaluation_id = r.json()["job_id"]
            assert (await stack.wait_done(evaluation_id))["status"] == "completed"
        as_member = (await stack.member_http.get(f"/v1/evaluations/{evaluation_id}")).json()
        as_reviewer = (await stack.http.get(f"/v1/evaluations/{evaluation_id}")).json()
        assert as_member["withheld"] == ["answer"] and as_reviewer["withheld"] == []
        [seen], [told] = as_member["report"]["outcomes"], as_reviewer["report"]["outcomes"]
        assert told["answer"] == "Probably somewhere warm, I would guess." and told["answer_correct"] is False
        assert seen["answer"] is None and seen["answer_correct"] is False
