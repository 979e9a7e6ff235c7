"""End to end with the real local model (llama.cpp + Qwen2.5-Coder-0.5B, the `make run` default):
ingest a short document, ask a question whose answer is in it, get an answer that cites it; a follow-up does
not wait for the side steps of the turn before it; and an agent's plan steps are calls of its tools."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from temporalio.service import RPCError

from activities.agent import checked_call
from ragline import prompts
from ragline.llm import ChatModel, StreamedCompletion
from ragline.settings import Settings
from tests.conftest import running_stack
from tests.helpers import eventually
from tests.local_llm import local_llm_unavailable, model_dir, start_local_llm
from workflows.chat import RAN_AGAIN, ChatTurnWorkflow

DOCUMENT = ("Brightwater Lighthouse stands on the northern cape of the island of Vell. "
            "Its keeper is Marta Quill, who has kept the light burning since 1987. "
            "The lamp is lit every evening at dusk and can be seen from 30 kilometres away.")


@pytest.fixture(scope="module")
def local_llm() -> str:
    reason = local_llm_unavailable()
    if reason:
        pytest.fail(f"`make test` installs the local model; {reason}")
    base_url, stop = start_local_llm(model_dir())
    yield base_url
    stop()


SHIPPED_POLICIES = Path(__file__).resolve().parent.parent / "temporal" / "policies.toml"
COLLECTION = "e2e-follow-up"  # the follow-up test's own (the answer cache is keyed by collection)


async def test_real_local_model_answers_from_an_ingested_document(temporal_env, scripted_llm, local_llm, tmp_path,
                                                                  restore_policies):
    """On the policies `make run` ships: the model serves one call at a time, so a side step may wait
    behind the answer for longer than the test suite's 10 s timeouts on a busy host (it then timed out
    on every attempt and the turn was dead-lettered)."""
    address = temporal_env.client.service_client.config.target_host
    async with running_stack(address, scripted_llm, tmp_path, task_queue="ragline-local-llm",
                             llm_base_url=local_llm, llm_model="local", llm_timeout=240,
                             llm_max_tokens=96, policies=SHIPPED_POLICIES) as stack:
        body = await stack.upload(("lighthouse.txt", DOCUMENT.encode()), collection="e2e")
        assert (await stack.wait_job(body["job_id"]))["status"] == "completed"
        accepted = await stack.chat("Who is the keeper of Brightwater Lighthouse?", collection="e2e")
        job = await stack.wait_job(accepted["job_id"], timeout=600)
    assert job["status"] == "completed", job
    result = job["result"]
    assert result["answer"].strip()
    assert result["citations"], f"the answer cites nothing: {result['answer']!r}"
    assert result["citations"][0]["document_id"] == body["documents"][0]["document_id"]
    assert result["model"] and result["usage"]["completion_tokens"] > 0


async def test_on_the_local_model_a_follow_up_does_not_wait_for_the_side_steps_before_it(
        temporal_env, scripted_llm, local_llm, tmp_path, restore_policies):
    """One model call at a time, as `make run` gives the local model: the first turn's summary and entities, under
    way when the next question comes, stop for its answer and run after it (the first of them to run says so).
    Both turns complete, the first with its summary."""
    address = temporal_env.client.service_client.config.target_host
    # A collection and question of its own: the answer cache (the test above asks in "e2e") would answer the
    # first question without the model, and no side step would run.
    async with running_stack(address, scripted_llm, tmp_path, task_queue="ragline-local-llm-aside",
                             llm_base_url=local_llm, llm_model="local", llm_timeout=240, llm_max_tokens=96,
                             llm_concurrency=1, policies=SHIPPED_POLICIES) as stack:
        body = await stack.upload(("lighthouse.txt", DOCUMENT.encode()), collection=COLLECTION)
        assert (await stack.wait_job(body["job_id"]))["status"] == "completed"
        first = await stack.chat("Who keeps the light of Brightwater Lighthouse?", collection=COLLECTION)
        handle = stack.client.get_workflow_handle(first["job_id"])

        async def answer_shown() -> bool:
            try:
                return (await handle.query(ChatTurnWorkflow.progress)).answer is not None
            except RPCError:  # its session has not started it yet
                return False

        await eventually(answer_shown, timeout=300, every=0.1, what="the first turn's answer")
        second = await stack.chat("When is the lamp lit?", session_id=first["session_id"], collection=COLLECTION)
        jobs = [await stack.wait_done(t["job_id"], timeout=600) for t in (first, second)]
    assert [j["status"] for j in jobs] == ["completed", "completed"], jobs
    assert jobs[0]["result"]["summary"].strip()
    details = {s["name"]: s.get("detail") for s in jobs[0]["steps"]}
    assert RAN_AGAIN in (details["summarize_context"], details["extract_entities"]), details


# Goals the shipped model, given OpenAI `tools`, answered with tools it made up (`compare_hotel_limit`,
# `list_steps_to_reset_password`), and one in Chinese.
AGENT_GOALS = ["Compare the travel policy's hotel limit with the onboarding guide's laptop budget.",
               "List the steps to reset a password described in the product FAQ.",
               "总结事故复盘中的根本原因"]


async def test_real_local_model_plans_only_calls_of_its_tools(local_llm):
    """As `make run` drives it (its replies held to the tools' schemas: test_localmodel.py checks that
    `make run` gives its worker RAGLINE_LLM_TOOL_CALLS=schema), the shipped model's every plan step is one
    call of an allowed tool with valid arguments: an agent on it searches, delegates or finishes, instead
    of spending its budget on corrections."""
    model = ChatModel(Settings(llm_base_url=local_llm, llm_tool_calls="schema", llm_model="local",
                               llm_timeout=240, llm_max_tokens=256))
    tools = prompts.agent_tools()
    allowed = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    try:
        for goal in AGENT_GOALS:
            plan = await model.plan(prompts.messages("agent", goal=goal, instructions="(none)", depth="0",
                                                     max_depth="2", observations="(none)"), tools, step="agent")
            assert len(plan.calls) == 1, (goal, plan.text)
            [call] = plan.calls
            checked = checked_call(call.name, call.arguments, allowed)
            assert checked.error is None, (goal, checked.error, json.loads(call.arguments))
    finally:
        await model.close()


async def test_real_local_models_answer_stream_is_not_cut_by_another_call(local_llm):
    """llama-cpp-python's server ends a streaming reply as soon as another request arrives, unless started
    with --interrupt_requests False (devtools/localmodel.py): with answers, summaries and agent plans of
    several jobs in flight, answers were cut to their first words."""
    model = ChatModel(Settings(llm_base_url=local_llm, llm_model="local", llm_timeout=240, llm_max_tokens=160))
    reply = StreamedCompletion(model="local")
    other = None
    try:
        async for _ in model.stream([{"role": "user", "content": "Count from 1 to 40, separated by commas."}],
                                    reply, step="generate"):
            if other is None:  # another call while the answer streams
                other = asyncio.create_task(model.complete([{"role": "user", "content": "Say hi."}], step="entities",
                                                           max_tokens=5))
        assert (await other).text
    finally:
        await model.close()
    # Cut, the stream would have ended after its first pieces ("1, 2") and raised (no finish_reason).
    assert "10, 11, 12" in reply.text, reply.text


async def test_real_local_models_entities_of_a_chinese_passage_parse(local_llm):
    """Asked for the entities of a Chinese passage, the shipped model replied "[1]" (the walkthrough: every
    turn about the Chinese document warned "invalid JSON twice"); held to the array's schema, it parses.
    One passage is enough: without the schema the model replies "[1]" to it too (checked), and on one
    llama.cpp thread beside the other tests the test took 18-43 s with three passages."""
    from activities.chat import ENTITIES_FORMAT, parse_entities
    from bench.quality import DOCS
    from models.ingest import SearchHit
    from ragline import text

    model = ChatModel(Settings(llm_base_url=local_llm, llm_tool_calls="schema", llm_model="local", llm_timeout=240,
                               llm_max_tokens=160))
    handbook = DOCS / "ops-handbook-zh.md"
    chunks = text.chunk_pages(text.extract_pages(handbook.read_bytes(), "text"), size=800, overlap=120)[:1]
    passages = prompts.format_passages([SearchHit(text=c.text, document_id="d", filename=handbook.name, page=c.page,
                                                  chunk=c.index, score=0.9) for c in chunks])
    messages = prompts.messages("extract_entities", passages=passages, question="单次大模型调用的超时阈值是多少秒？")
    try:
        reply = await model.complete(messages, step="extract_entities", response_format=ENTITIES_FORMAT)
    finally:
        await model.close()
    entities = parse_entities(reply.text)
    assert entities is not None and entities, reply.text
