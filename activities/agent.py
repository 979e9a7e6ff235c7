"""Agent activities: plan the next tool calls with the model, and search the documents."""

from __future__ import annotations

import json

from temporalio import activity

from activities.heartbeats import heartbeating
from activities.search import find_passages
from models.agent import PlanInput, PlanOutput, SearchDocumentsInput, SearchDocumentsOutput, ToolCall
from ragline import prompts
from ragline.embeddings import Embedder
from ragline.llm import ChatModel
from ragline.vectorstore import VectorIndex
from temporal.errors import translate_errors

OBSERVATION_CHARS = 600


class AgentActivities:
    def __init__(self, embedder: Embedder, index: VectorIndex, model: ChatModel) -> None:
        self.embedder = embedder
        self.index = index
        self.model = model

    @activity.defn
    @translate_errors
    async def agent_plan(self, req: PlanInput) -> PlanOutput:
        messages = prompts.messages(
            "agent", goal=req.goal, instructions=req.instructions or "(none)", depth=str(req.depth),
            max_depth=str(req.max_depth), observations="\n".join(f"- {o}" for o in req.observations) or "(none)")
        tools = prompts.agent_tools()
        async with heartbeating():
            plan = await self.model.plan(messages, tools, step="agent")
        allowed = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        return PlanOutput(calls=[checked_call(c.name, c.arguments, allowed) for c in plan.calls], text=plan.text,
                          prompt_tokens=plan.prompt_tokens, completion_tokens=plan.completion_tokens,
                          attempt=activity.info().attempt)

    @activity.defn
    @translate_errors
    def search_documents(self, req: SearchDocumentsInput) -> SearchDocumentsOutput:
        hits = find_passages(self.embedder, self.index, req.tenant, req.collection, req.query, req.top_k)
        if not hits:
            text = f"search_documents({req.query!r}): nothing found"
        else:
            text = " | ".join(f"[{h.filename}, p.{h.page}] {h.text}" for h in hits)
        return SearchDocumentsOutput(observation=text[:OBSERVATION_CHARS], attempt=activity.info().attempt)


def checked_call(name: str, arguments: str, allowed: dict[str, dict]) -> ToolCall:
    """Hold a model's tool call to the allowlist and the tool's schema; errors become tool errors."""
    if name not in allowed:
        return ToolCall(name=name, error=f"unknown tool {name!r}; allowed: {', '.join(sorted(allowed))}")
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
