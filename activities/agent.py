"""Agent activities: plan the next tool calls with the model, and search the documents."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from temporalio import activity

from activities.heartbeats import heartbeating
from activities.search import find_passages
from models.agent import (
    PlanCorrection, PlanInput, PlanOutput, SearchDocumentsInput, SearchDocumentsOutput, ToolCall,
)
from ragline import prompts
from ragline.embeddings import Embedder
from ragline.errors import ModelReplyError
from ragline.llm import ChatModel, tool_calls_in_text
from ragline.vectorstore import VectorIndex
from temporal.errors import translate_errors

OBSERVATION_CHARS = 600  # a search's observation, shared by its hits (3 by default)


class AgentActivities:
    def __init__(self, embedder: Embedder, index: VectorIndex, model: ChatModel) -> None:
        self.embedder = embedder
        self.index = index
        self.model = model

    @activity.defn
    @translate_errors
    async def agent_plan(self, req: PlanInput) -> PlanOutput:
        tools = prompts.agent_tools()
        allowed = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        messages = prompts.messages(
            "agent", goal=req.goal, instructions=req.instructions or "(none)", depth=str(req.depth),
            max_depth=str(req.max_depth), observations="\n".join(f"- {o}" for o in req.observations) or "(none)")
        if req.correction is not None:
            messages += correction_messages(req.correction, allowed)
        async with heartbeating():
            plan = await self.model.plan(messages, tools, step="agent")
        malformed = None if plan.calls else malformed_tool_call(plan.text, allowed)
        if malformed and req.correction is not None:
            raise ModelReplyError(
                f"the agent's model wrote no usable plan step, even when told what was wrong: {malformed}. Run the "
                "agent again, or configure a model that calls tools reliably (RAGLINE_LLM_BASE_URL, RAGLINE_LLM_MODEL)")
        return PlanOutput(calls=[checked_call(c.name, c.arguments, allowed) for c in plan.calls], text=plan.text,
                          malformed=malformed, prompt_tokens=plan.prompt_tokens,
                          completion_tokens=plan.completion_tokens, attempt=activity.info().attempt)

    @activity.defn
    @translate_errors
    def search_documents(self, req: SearchDocumentsInput) -> SearchDocumentsOutput:
        hits = find_passages(self.embedder, self.index, req.tenant, req.collection, req.query, req.top_k)
        if not hits:
            text = f"search_documents({req.query!r}): nothing found"
        else:
            # Each hit gets its share: cut as a whole, the first passage filled the observation alone, and the
            # agent saw one passage whatever it searched.
            share = OBSERVATION_CHARS // len(hits)
            text = " | ".join(f"[{h.filename}, p.{h.page}] {h.text[:share]}" for h in hits)
        # Up to 8 of these go into every plan: in Chinese (a token a character) that fills a 4,096-token context.
        return SearchDocumentsOutput(observation=text[:OBSERVATION_CHARS], attempt=activity.info().attempt)


def checked_call(name: str, arguments: str, allowed: dict[str, dict]) -> ToolCall:
    """Hold a model's tool call to the allowlist and the tool's schema; errors become tool errors."""
    if name not in allowed:
        return ToolCall(name=name, error=unknown_tool(name, allowed))
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return ToolCall(name=name, error=f"arguments of {name} are not valid JSON")
    if not isinstance(args, dict):
        return ToolCall(name=name, error=f"arguments of {name} must be an object")
    schema = allowed[name]
    for key in schema.get("required", []):
        value = args.get(key)
        if not isinstance(value, str) or not value.strip():
            return ToolCall(name=name, error=f"{name} needs a non-empty string {key!r}")
    unknown = set(args) - set(schema.get("properties", {}))
    if unknown:
        return ToolCall(name=name, error=f"{name} got unknown argument(s): {', '.join(sorted(unknown))}")
    return ToolCall(name=name, arguments={k: v.strip() for k, v in args.items()})


def tool_names(allowed: Mapping[str, dict]) -> str:
    return ", ".join(sorted(allowed))


def unknown_tool(name: str, allowed: Mapping[str, dict]) -> str:
    return f"unknown tool {name!r}; allowed: {tool_names(allowed)}"


# Where a reply that is no parsed call may still hold one: Qwen's <tool_call> tags, a code fence (either
# perhaps cut off by max_tokens), or the bare reply.
_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_FENCED = re.compile(r"```[A-Za-z]*\s*(.*?)\s*(?:```|$)", re.DOTALL)
# JSON means a call when it names one of the tools, or, as the whole reply, has a tool-call key. A plain
# "name" is common in data ({"name": "ACME"}), and prose may quote JSON with a "function" key.
_NAME_KEYS = ("name", "tool", "tool_name", "function")
_NAMED = re.compile(r'"(?:%s)"\s*:\s*"([^"]*)"' % "|".join(_NAME_KEYS))
_CALL_KEY = re.compile(r'"(?:tool|tool_name|tool_calls|function|function_call|arguments|args|parameters)"\s*:')


def malformed_tool_call(text: str, allowed: Mapping[str, dict]) -> str | None:
    """What is wrong with a reply that evidently tries to be a tool call (<tool_call> tags, or JSON that
    calls a tool, bare or in a code fence) though no call could be read from it; None for any other
    reply, which is a final answer (prose that mentions or quotes JSON included). Meant for a reply in
    which no call was found."""
    tagged = _TAGGED.findall(text)
    fenced = [] if tagged else _FENCED.findall(text)
    alone = not fenced or not _FENCED.sub("", text).strip()  # no prose around the JSON
    attempts = tagged or [body for body in fenced or [text.strip()] if _looks_like_call(body, allowed, alone)]
    if not attempts and not fenced and (start := _JSON_START.search(text)) and text[:start.start()].strip():
        # Prose, then JSON that names a tool ("Let me check.\n{"name": "finish", ...}"): a call, not an answer.
        return PROSE_AROUND_CALL if _looks_like_call(text[start.start():].strip(), allowed, alone=False) else None
    if not attempts:
        return None
    return next((problem for body in attempts if (problem := _call_problem(body, allowed))),
                PROSE_AROUND_CALL)


PROSE_AROUND_CALL = "a tool call is the whole reply, without prose around it"
_JSON_START = re.compile(r'[{\[]\s*["{]')  # where an object, or a list of them, starts
# Keys a tool call is made of, in the shapes models write: JSON that parses and has any other key is data.
_CALL_SHAPE = frozenset({*_NAME_KEYS, "tool_calls", "function_call", "arguments", "args", "parameters", "type", "id"})


def _looks_like_call(body: str, allowed: Mapping[str, dict], alone: bool) -> bool:
    if not body.startswith(("{", "[")):
        return False
    if any(name in allowed for name in _NAMED.findall(body)):
        return True
    if not alone or not _CALL_KEY.search(body):
        return False
    try:
        value = json.loads(body)
    except ValueError:
        return True  # broken JSON with a tool-call key: a call that went wrong
    items = value if isinstance(value, list) else [value]
    return bool(items) and all(isinstance(i, dict) and i.keys() <= _CALL_SHAPE for i in items)


def _call_problem(body: str, allowed: Mapping[str, dict]) -> str | None:
    """What is wrong with the JSON of a call; None when it is one the model client reads."""
    try:
        value = json.loads(body)
    except ValueError as exc:
        return f"the tool call was not valid JSON ({exc})"
    for item in value if isinstance(value, list) else [value]:
        name = _called_name(item)
        if not isinstance(name, str):
            return f"the tool call names no tool; allowed: {tool_names(allowed)}"
        if name not in allowed:
            return unknown_tool(name, allowed)
    if not tool_calls_in_text(body):  # a tool that exists, under other keys or with extra ones
        return 'a tool call is written {"name": "<tool>", "arguments": {...}}'
    return None


def _called_name(item: object) -> object:
    """The tool a parsed call names, under whichever key the model put it (OpenAI's nesting included)."""
    if not isinstance(item, dict):
        return None
    if isinstance(item.get("tool_calls"), list) and item["tool_calls"]:
        return _called_name(item["tool_calls"][0])
    if isinstance(item.get("function"), dict):
        return _called_name(item["function"])
    return next((item[key] for key in _NAME_KEYS if isinstance(item.get(key), str)), None)


def correction_messages(correction: PlanCorrection, allowed: Mapping[str, dict]) -> list[dict[str, str]]:
    """The malformed reply as the model wrote it, then what was wrong with it: the model's one chance to
    write the step again."""
    said = prompts.text("agent", "correction").format(problem=correction.problem, tools=tool_names(allowed))
    return [{"role": "assistant", "content": correction.reply}, {"role": "user", "content": said}]
