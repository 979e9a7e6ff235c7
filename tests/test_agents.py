"""Agents delegate to sub-agents as child workflows; guards stop them for human review."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from devtools.devserver import temporal_binary

DEPTH = re.compile(r"DEPTH: (\d+) of at most (\d+)")


def _depth(body: dict) -> int:
    text = body["messages"][-1]["content"]
    return int(DEPTH.search(text).group(1))


def _fresh(body: dict) -> bool:
    return "OBSERVATIONS SO FAR:\n(none)" in body["messages"][-1]["content"]


def _goal(body: dict) -> str:
    return body["messages"][-1]["content"].split("GOAL: ", 1)[1].split("\n", 1)[0]


def delegate_until(leaf_depth: int):
    """The scripted model delegates on its first plan until `leaf_depth`, then finishes."""
    def plan(body: dict) -> dict:
        depth = _depth(body)
        if _fresh(body) and depth < leaf_depth:
            return {"tool_calls": [{"name": "delegate", "arguments": {"subgoal": f"level {depth + 1} part"}}]}
        return {"tool_calls": [{"name": "finish", "arguments": {"answer": f"answer from depth {depth}"}}]}
    return plan


async def _start(stack, goal: str, **extra) -> str:
    r = await stack.http.post("/v1/agents", json={"goal": goal, "collection": "agents", **extra})
    assert r.status_code == 202, r.text
    return r.json()["job_id"]


async def _waiting(stack, *, count: int = 1, timeout: float = 60) -> list[dict]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        reviews = (await stack.http.get("/v1/reviews")).json()["reviews"]
        if len(reviews) >= count:
            return reviews
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"expected {count} review(s), got {reviews}")
        await asyncio.sleep(0.3)


async def _cli(stack, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        temporal_binary(), *args, "--address", stack.settings.temporal_address,
        # Payloads are encrypted: the CLI encodes its input through the API's codec endpoint.
        "--codec-endpoint", f"{stack.base_url}/codec", "--codec-auth", f"Bearer {stack.keys['reviewer']}",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, out.decode()
    return out.decode()


def _node_at(tree: dict, depth: int) -> dict:
    node = tree
    while node["depth"] < depth:
        node = node["children"][0]
    return node


@pytest.fixture(autouse=True)
def _no_leftover_script(stack):
    yield
    stack.llm.script_fn("agent", None)


async def test_depth_guard_waits_and_cli_approval_continues(stack):
    stack.llm.script_fn("agent", delegate_until(leaf_depth=4))
    job_id = await _start(stack, "Map the harbour records", max_depth=3)
    [review] = await _waiting(stack)
    assert review["reason"] == "depth" and review["depth"] == 3
    assert review["proposed_action"] == {"action": "delegate", "subgoals": ["level 4 part"]}
    assert review["job_id"].startswith(job_id) and review["job_id"].count(".") == 1 + 3  # tenant prefix, then one per depth
    assert (await stack.http.get(f"/v1/jobs/{review['job_id']}")).json()["status"] == "waiting_review"

    # Approve with the real `temporal` CLI, as an operator would.
    payload = {"decision": "approve", "reviewer": "cli-operator", "comment": "one more level", "extra_depth": 1}
    await _cli(stack, "workflow", "update", "execute", "-w", review["workflow_id"], "--name", "review",
               "--input", json.dumps(payload))
    job = await stack.wait_done(job_id, timeout=120)
    assert job["status"] == "completed", job
    result = job["result"]
    assert result["status"] == "finished" and result["answer"]
    assert _node_at(result["tree"], 4)["answer"] == "answer from depth 4"
    assert result["llm_calls"] >= 9
    [decision] = result["decisions"]
    assert decision["reviewer"] == "cli-operator" and decision["decision"] == "approve"
    assert decision["reason"] == "depth" and decision["decided_at"]
    assert (await stack.http.get("/v1/reviews")).json()["reviews"] == []


async def test_reject_finishes_with_a_partial_answer(stack):
    stack.llm.script_fn("agent", delegate_until(leaf_depth=9))
    job_id = await _start(stack, "Summarise every ledger", max_depth=1)
    [review] = await _waiting(stack)
    r = await stack.http.post(f"/v1/jobs/{review['job_id']}/review",
                              json={"decision": "reject", "reviewer": "ana", "comment": "deep enough"})
    assert r.status_code == 200, r.text
    job = await stack.wait_done(job_id)
    stopped = _node_at(job["result"]["tree"], 1)
    assert stopped["status"] == "stopped" and stopped["answer"].startswith("Stopped")
    assert job["result"]["decisions"][0]["comment"] == "deep enough"
    again = await stack.http.post(f"/v1/jobs/{review['job_id']}/review",
                                  json={"decision": "approve", "reviewer": "ana"})
    assert again.status_code == 409


async def test_budget_guard_trips_and_waits(stack):
    stack.llm.script_fn("agent", delegate_until(leaf_depth=9))
    job_id = await _start(stack, "Count the ships", max_depth=5, budget={"max_llm_calls": 2})
    [review] = await _waiting(stack)
    assert review["reason"] == "budget" and review["depth"] == 1
    # The child got only what was left of the shared budget.
    assert "model calls left" in review["detail"] or "budget used up" in review["detail"]
    await stack.http.post(f"/v1/jobs/{review['job_id']}/review", json={"decision": "reject", "reviewer": "bo"})
    # A rejection sticks for the tree: the root finishes with what it has instead of asking again.
    job = await stack.wait_done(job_id)
    assert job["status"] == "completed" and job["result"]["llm_calls"] == 2
    assert job["result"]["status"] == "stopped" and len(job["result"]["decisions"]) == 1


def always_delegate(body: dict) -> dict:
    """A model that delegates whatever it is asked, one level deeper each time."""
    return {"tool_calls": [{"name": "delegate", "arguments": {"subgoal": f"level {_depth(body) + 1} part"}}]}


async def test_a_rejected_delegation_is_not_proposed_again(stack):
    stack.llm.script_fn("agent", always_delegate)
    job_id = await _start(stack, "Survey the coastline", max_depth=1)
    [first] = await _waiting(stack)
    assert first["reason"] == "depth" and first["depth"] == 1
    r = await stack.http.post(f"/v1/jobs/{first['job_id']}/review",
                              json={"decision": "approve", "reviewer": "ann", "extra_depth": 1})
    assert r.status_code == 200, r.text
    second = None
    for _ in range(200):
        second = next((x for x in (await stack.http.get("/v1/reviews")).json()["reviews"]
                       if x["job_id"].startswith(job_id) and x["depth"] == 2), None)
        if second:
            break
        await asyncio.sleep(0.1)
    assert second is not None and second["proposed_action"]["subgoals"] == ["level 3 part"]
    await stack.http.post(f"/v1/jobs/{second['job_id']}/review", json={"decision": "reject", "reviewer": "ann"})
    # The whole tree finishes with what it has; nobody is asked about the same delegation again.
    job = await stack.wait_done(job_id, timeout=60)
    assert job["status"] == "completed" and job["result"]["status"] == "stopped"
    assert [d["decision"] for d in job["result"]["decisions"]] == ["approve", "reject"]
    tree_reviews = [x for x in (await stack.http.get("/v1/reviews")).json()["reviews"]
                    if x["job_id"].startswith(job_id)]
    assert tree_reviews == []
    listed = (await stack.http.get("/v1/jobs", params={"kind": "agent", "limit": 1000})).json()["jobs"]
    tree = [j for j in listed if j["job_id"].startswith(job_id)]
    # root, one child, one grandchild: the child did not delegate the rejected branch a second time
    assert sorted(j["job_id"] for j in tree) == [job_id, f"{job_id}.1", f"{job_id}.1.1"]
    assert all(j["status"] == "completed" for j in tree)


async def test_loop_guard_trips_on_a_repeated_goal(stack):
    def loop(body: dict) -> dict:
        if _fresh(body):
            return {"tool_calls": [{"name": "delegate", "arguments": {"subgoal": _goal(body).upper() + "!"}}]}
        return {"tool_calls": [{"name": "finish", "arguments": {"answer": "done"}}]}

    stack.llm.script_fn("agent", loop)
    job_id = await _start(stack, "Find the lighthouse keeper")
    [review] = await _waiting(stack)
    assert review["reason"] == "loop" and review["depth"] == 0 and review["job_id"] == job_id
    # A revise decision continues with the reviewer's instructions instead of the delegation.
    r = await stack.http.post(f"/v1/jobs/{job_id}/review", json={
        "decision": "revise", "reviewer": "cy", "instructions": "search the documents yourself"})
    assert r.status_code == 200
    job = await stack.wait_done(job_id)
    assert job["status"] == "completed" and job["result"]["answer"] == "done"
    plans = [c for c in stack.llm.calls if c.task == "agent" and "Find the lighthouse keeper" in c.user_message]
    assert "search the documents yourself" in plans[-1].user_message


async def test_signal_reviews_record_bad_input_and_accept_good_input(stack):
    stack.llm.script_fn("agent", delegate_until(leaf_depth=9))
    job_id = await _start(stack, "Read the tide tables", max_depth=0)
    [review] = await _waiting(stack)
    await _cli(stack, "workflow", "signal", "-w", job_id, "--name", "review",
               "--input", json.dumps({"decision": "maybe", "reviewer": "dee"}))
    for _ in range(50):
        pending = (await stack.http.get("/v1/reviews")).json()["reviews"]
        if pending and pending[0]["rejected_inputs"]:
            break
        await asyncio.sleep(0.2)
    assert "decision" in pending[0]["rejected_inputs"][0]["error"]
    await _cli(stack, "workflow", "signal", "-w", job_id, "--name", "review",
               "--input", json.dumps({"decision": "reject", "reviewer": "dee"}))
    job = await stack.wait_done(job_id)
    assert job["status"] == "completed" and job["result"]["status"] == "stopped"


async def test_bad_tool_calls_are_tool_errors_and_events_carry_depth(stack):
    stack.llm.script("agent", [{"tool_calls": [{"name": "rm_rf", "arguments": {"path": "/"}}]},
                               {"tool_calls": [{"name": "search_documents", "arguments": {"q": "x"}}]},
                               {"tool_calls": [{"name": "finish", "arguments": {"answer": "safe"}}]}])
    job_id = await _start(stack, "Try something odd")
    job = await stack.wait_done(job_id)
    assert job["status"] == "completed" and job["result"]["answer"] == "safe"
    last_plan = [c for c in stack.llm.calls if c.task == "agent" and "Try something odd" in c.user_message][-1]
    assert "unknown tool 'rm_rf'" in last_plan.user_message
    assert "search_documents needs a non-empty string 'query'" in last_plan.user_message

    from tests.test_events import read_events
    events = await read_events(stack, job_id)
    assert all(e["data"].get("depth") == 0 for _, e in events)


async def test_limits_above_the_ceiling_are_refused(stack):
    r = await stack.http.post("/v1/agents", json={"goal": "x", "max_depth": 99})
    assert r.status_code == 422 and "max_depth" in r.json()["error"]["message"]
    r = await stack.http.post("/v1/agents", json={"goal": "x", "budget": {"max_llm_calls": 10**6}})
    assert r.status_code == 422


async def test_chat_with_require_review_releases_the_answer_only_after_approval(stack):
    seed = await stack.upload(("tides.txt", b"High tide at Vell harbour is at noon. Low tide follows at six."),
                              collection="reviewed")
    await stack.wait_job(seed["job_id"])
    r = await stack.http.post("/v1/chats", json={"message": "When is high tide at Vell?", "collection": "reviewed",
                                                 "require_review": True})
    job_id = r.json()["job_id"]
    [review] = await _waiting(stack)
    assert review["job_id"] == job_id and review["reason"] == "review requested"
    assert "[1]" in review["proposed_action"]["answer"]
    held = (await stack.http.get(f"/v1/jobs/{job_id}")).json()
    assert held["status"] == "waiting_review" and held["result"] is None
    session = (await stack.http.get(f"/v1/chats/{r.json()['session_id']}")).json()
    assert session["turns"][0]["answer"] is None

    await stack.http.post(f"/v1/jobs/{job_id}/review", json={
        "decision": "approve", "reviewer": "editor", "answer": "High tide is at noon [1]."})
    job = await stack.wait_done(job_id)
    assert job["status"] == "completed"
    assert job["result"]["answer"] == "High tide is at noon [1]."
    assert job["result"]["review"]["reviewer"] == "editor"


async def test_unsupported_answers_are_held_when_configured(temporal_env, scripted_llm, tmp_path):
    from tests.conftest import running_stack

    address = temporal_env.client.service_client.config.target_host
    async with running_stack(address, scripted_llm, tmp_path, task_queue="ragline-unsupported",
                             review_unsupported_answers=True) as stack:
        seed = await stack.upload(("birds.txt", b"Puffins nest on the cliffs of Vell every spring."),
                                  collection="birds")
        await stack.wait_job(seed["job_id"])
        supported = await stack.chat("Where do puffins nest?", collection="birds")
        assert (await stack.wait_job(supported["job_id"]))["status"] == "completed"  # cites [1]: released

        scripted_llm.script("answer", ["Probably somewhere warm, I would guess."])
        held = await stack.chat("Where do swallows go in winter?", collection="birds")
        job = await stack.wait_job(held["job_id"])
        assert job["status"] == "waiting_review"
        [review] = (await stack.http.get("/v1/reviews")).json()["reviews"]
        assert review["reason"] == "answer without a supporting citation"
        await stack.http.post(f"/v1/jobs/{held['job_id']}/review", json={"decision": "reject", "reviewer": "ed",
                                                                         "comment": "unsupported"})
        job = await stack.wait_done(held["job_id"])
        assert job["status"] == "failed" and "answer rejected by ed: unsupported" in job["error"]["message"]
