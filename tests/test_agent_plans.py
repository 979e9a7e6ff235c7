"""Reading an agent's plan reply without any server: a reply that tries to be a tool call and is malformed
is no final answer (the agent re-plans once, told what was wrong); prose is one, even when it mentions
JSON. The end-to-end runs are in tests/test_agents.py."""

from __future__ import annotations

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

import worker
from activities.agent import AgentActivities, malformed_tool_call
from models.agent import PlanCorrection, PlanInput
from ragline import prompts
from ragline.llm import ToolChoice, ToolPlan
from temporal import policies
from tests.conftest import FIXTURES

ALLOWED = {t["function"]["name"]: t["function"]["parameters"] for t in prompts.agent_tools()}


@pytest.mark.parametrize("reply, problem", [
    # Not JSON at all, bare, fenced, or cut off by max_tokens inside a fence or <tool_call> tags.
    ('{"name": "finish", "arguments": {"answer": "noon"}', "the tool call was not valid JSON"),
    ('```json\n{"name": "search_documents", "arguments": {query: tides}}\n```', "the tool call was not valid JSON"),
    ('```json\n{"tool": "finish", "arguments": {"answer": "no', "the tool call was not valid JSON"),
    ('<tool_call>\n{"name": "finish", "arguments": {"answer": "noon"}', "the tool call was not valid JSON"),
    # A tool under another key, or none named.
    ('{"tool": "lookup", "arguments": {"q": "tides"}}', "unknown tool 'lookup'; allowed: delegate, finish"),
    ('{"type": "function", "function": {"name": "browse", "arguments": "{}"}}', "unknown tool 'browse'"),
    ('{"arguments": {"answer": "noon"}}', "the tool call names no tool; allowed: delegate, finish"),
    # A real tool in a shape no parser reads: another key, extra keys; a good call amid prose.
    ('{"tool": "finish", "arguments": {"answer": "noon"}}', 'written {"name": "<tool>", "arguments": {...}}'),
    ('{"name": "finish", "arguments": {"answer": "noon"}, "id": "call_1"}', 'written {"name": "<tool>"'),
    ('I will look it up.\n```json\n{"name": "search_documents", "arguments": {"query": "tides"}}\n```',
     "the whole reply, without prose around it"),
    ('<tool_call>{"name": "finish", "arguments": {"answer": "noon"}}</tool_call> Done.', "without prose around it"),
    # A call after prose, without a fence or tags: the model meant to call, and said so first.
    ('I will hand this on.\n{"name": "delegate", "arguments": {"goal": "tides"}}', "without prose around it"),
    ('Done: {"name": "finish", "arguments": {"answer": "noon"}} as asked.', "without prose around it"),
])
def test_a_reply_that_tries_to_be_a_tool_call_says_what_is_wrong(reply, problem):
    assert problem in malformed_tool_call(reply, ALLOWED)


@pytest.mark.parametrize("reply", [
    "High tide at Vell is at noon.",
    "The report is a JSON file; its fields are name and arguments.",
    'The config sets {"name": "ACME", "revenue": 5} for the client.',
    'The record reads:\n{"name": "ACME", "arguments": "none", "revenue": 5}',  # data after prose, no tool named
    '{"name": "ACME", "revenue": 5}',  # data the goal asked for, not a call: no tool named, no call key
    # Data with a key a call would have, and keys no call has: not a call either.
    '{"name": "ACME", "parameters": {"x": 1}, "revenue": 5}',
    '[{"tool": "hammer", "price": 12}, {"tool": "saw", "price": 20}]',
    'Entities:\n```json\n[{"text": "Ada", "type": "PERSON"}]\n```',
    "```python\nprint('noon')\n```",
    # JSON the answer quotes, with a key a call would have: not a call of any of the tools.
    'The API is called like this:\n```json\n{"function": "create_user", "parameters": {"id": 1}}\n```',
    "",
])
def test_prose_and_plain_data_are_final_answers(reply):
    assert malformed_tool_call(reply, ALLOWED) is None


class ScriptedPlans:
    """A model that answers each plan with the next reply, and keeps the messages it was sent."""

    def __init__(self, *replies: ToolPlan) -> None:
        self.replies = list(replies)
        self.sent: list[list[dict]] = []

    async def plan(self, messages: list[dict], tools: list[dict], *, step: str) -> ToolPlan:
        self.sent.append(messages)
        return self.replies.pop(0)


def _text(reply: str) -> ToolPlan:
    return ToolPlan(text=reply, calls=[], model="scripted", prompt_tokens=10, completion_tokens=5)


@pytest.fixture
def fast_policies(restore_policies) -> None:
    policies.load(FIXTURES.parent / "fast_policies.toml", worker.activity_names())  # heartbeat interval


PLAN = PlanInput(goal="When is high tide?", depth=0, max_depth=3)
BROKEN = '{"name": "finish", "arguments": {"answer": "noon"}'


async def test_a_malformed_plan_is_marked_and_a_second_one_fails_for_good(fast_policies):
    model = ScriptedPlans(_text(BROKEN), _text(BROKEN))
    plans = AgentActivities(embedder=None, index=None, model=model)  # planning needs only the model
    first = await ActivityEnvironment().run(plans.agent_plan, PLAN)
    assert first.calls == [] and "not valid JSON" in first.malformed

    correction = PlanCorrection(reply=first.text, problem=first.malformed)
    with pytest.raises(ApplicationError) as caught:
        await ActivityEnvironment().run(plans.agent_plan, PLAN.model_copy(update={"correction": correction}))
    assert caught.value.type == "ModelReplyError" and caught.value.non_retryable
    assert "not valid JSON" in caught.value.message and "RAGLINE_LLM_MODEL" in caught.value.message
    # The re-plan showed the model its own reply and what was wrong with it.
    assistant, told = model.sent[1][-2:]
    assert assistant == {"role": "assistant", "content": BROKEN}
    assert told["role"] == "user" and first.malformed in told["content"]


async def test_a_corrected_plan_goes_on_as_usual(fast_policies):
    finish = ToolPlan(text="", calls=[ToolChoice(name="finish", arguments='{"answer": "Noon."}')], model="scripted")
    plans = AgentActivities(embedder=None, index=None, model=ScriptedPlans(finish, _text("Noon, I think.")))
    correction = PlanCorrection(reply=BROKEN, problem="the tool call was not valid JSON")
    called = await ActivityEnvironment().run(plans.agent_plan, PLAN.model_copy(update={"correction": correction}))
    assert called.malformed is None and called.calls[0].arguments == {"answer": "Noon."}
    answered = await ActivityEnvironment().run(plans.agent_plan, PLAN.model_copy(update={"correction": correction}))
    assert answered.malformed is None and answered.text == "Noon, I think."
