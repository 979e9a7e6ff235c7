"""The chat model client: the official `openai` client against any OpenAI-compatible endpoint.

The client's own retries are off and every call has an explicit timeout: Temporal owns retries,
and `ragline.provider_errors` maps failures onto the project's error taxonomy.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import structlog
from openai import AsyncOpenAI

from opentelemetry import trace

from ragline import metrics, tracing
from ragline.errors import TransientError
from ragline.provider_errors import translate_provider_errors
from ragline.redact import redact_messages
from ragline.settings import Settings


_tracer = trace.get_tracer("ragline.llm")
log = structlog.get_logger("ragline.llm")


@dataclass
class Completion:
    text: str
    model: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    repetition_cut: bool = False  # the reply fell into a loop: `text` ends where the loop began


@dataclass
class ToolChoice:
    name: str
    arguments: str  # JSON text as the model wrote it


_TOOL_CALL_TAG = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$")


def tool_calls_in_text(text: str) -> list[ToolChoice]:
    """Tool calls a model wrote as its reply's text, for a server that does not parse them into
    `tool_calls` (llama.cpp's server with a model's own chat template: Qwen answers
    `{"name": ..., "arguments": {...}}`, or the same inside <tool_call> tags). Only a reply that is
    nothing but calls counts; prose that quotes one stays prose."""
    text = text.strip()
    tagged = _TOOL_CALL_TAG.findall(text)
    if tagged:
        if _TOOL_CALL_TAG.sub("", text).strip():
            return []
        parts = tagged
    else:
        parts = [_FENCE.sub("", text)]
    calls = []
    for part in parts:
        try:
            value = json.loads(part)
        except ValueError:
            return []
        for item in value if isinstance(value, list) else [value]:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str) and set(item) <= {"name", "arguments"}):
                return []
            arguments = item.get("arguments", {})
            calls.append(ToolChoice(name=item["name"],
                                    arguments=arguments if isinstance(arguments, str) else json.dumps(arguments)))
    return calls


def tool_call_format(tools: list[dict]) -> dict:
    """llama.cpp's `response_format` for a reply that is exactly one call of one of `tools`: its name one
    of theirs, its arguments valid for that tool's parameters (the server turns the schema into a grammar)."""
    return {"type": "json_object", "schema": {"anyOf": [
        {"type": "object", "required": ["name", "arguments"],
         "properties": {"name": {"const": t["function"]["name"]}, "arguments": t["function"]["parameters"]}}
        for t in tools]}}


def json_array_format(item: dict, *, max_items: int) -> dict:
    """llama.cpp's `response_format` for a reply that is a JSON array of `item`s, at most `max_items`: the
    small local model asked for entities wrote prose, "[1]" or minutes of broken JSON; held to the grammar,
    its reply is the array and nothing else."""
    return {"type": "json_object", "schema": {"type": "array", "items": item, "maxItems": max_items}}


@dataclass
class ToolPlan:
    text: str
    calls: list[ToolChoice]
    model: str
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class StreamedCompletion:
    """Filled while `stream()` is iterated."""

    model: str
    parts: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # The reply fell into a loop: `stream()` stopped reading it and `parts` end at the loop's first occurrence.
    repetition_cut: bool = False

    @property
    def text(self) -> str:
        return "".join(self.parts)


# Degenerate repetition: a small model (the default 0.5B Qwen) sometimes loops on one short unit
# ("[1] [2] [1] [2] …") or on a whole sentence until max_tokens. A reply's tail counts as such a loop when
# one unit of at most LOOP_MAX_UNIT characters repeats LOOP_MIN_REPEATS times or more in a row, over
# LOOP_MIN_CHARS or more, or one longer unit (a sentence, a paragraph, up to LONG_LOOP_MAX_UNIT) with
# letters or digits in it LONG_LOOP_MIN_REPEATS times. Prose, numbered lists and code never repeat words
# that much verbatim. Layout does: a rule of "=" or "——", a dot leader, a blank table's identical rows
# (a short unit with a line break, or with no letter or digit in it) count only from LAYOUT_MIN_REPEATS
# repeats over LAYOUT_MIN_CHARS; a long unit without a letter or digit never counts.
LOOP_MAX_UNIT = 50
LOOP_MIN_REPEATS = 8
LOOP_MIN_CHARS = 150
LONG_LOOP_MAX_UNIT = 300
LONG_LOOP_MIN_REPEATS = 4
LAYOUT_MIN_REPEATS = 30
LAYOUT_MIN_CHARS = 600
# The guard looks at the reply's tail once per this many new characters: a loop is caught a few words
# later, and a long reply costs a few dozen checks, not one per token.
LOOP_CHECK_EVERY = 64
# The longest run a check needs to see, and a unit more for a piece that ends mid-unit.
LOOP_WINDOW = max(LOOP_MAX_UNIT * LAYOUT_MIN_REPEATS, LONG_LOOP_MAX_UNIT * LONG_LOOP_MIN_REPEATS) + LONG_LOOP_MAX_UNIT


def _periodic_tail(text: str, period: int) -> int:
    """How many characters at the end of `text` repeat with this period (counting the last unit itself)."""
    i = len(text) - period - 1
    while i >= 0 and text[i] == text[i + period]:
        i -= 1
    return len(text) - i - 1


def _thresholds(unit: str) -> tuple[int, int]:
    """(repeats, characters) from which a run of `unit` is a loop (for one that never is, more repeats
    than the guard's window holds)."""
    words = any(c.isalnum() for c in unit)
    if len(unit) > LOOP_MAX_UNIT:
        return (LONG_LOOP_MIN_REPEATS, 0) if words else (LOOP_WINDOW + 1, 0)
    if "\n" in unit or not words:
        return LAYOUT_MIN_REPEATS, LAYOUT_MIN_CHARS
    return LOOP_MIN_REPEATS, LOOP_MIN_CHARS


def cut_repetition(text: str) -> str | None:
    """`text` with a looping tail cut down to one occurrence of what repeats (the shortest such unit), or
    None when its tail does not loop. The cut keeps the text before the loop and the loop's first unit."""
    for period in range(1, min(LONG_LOOP_MAX_UNIT, len(text) // LONG_LOOP_MIN_REPEATS) + 1):
        if text[-1] != text[-1 - period]:
            continue  # the common case, answered without a scan
        run = _periodic_tail(text, period)
        repeats, chars = _thresholds(text[len(text) - period:])
        if run // period >= repeats and run >= chars:
            return text[:len(text) - run + period]
    return None


_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
CHARS_PER_TOKEN = 4  # of text that is not CJK, about


def estimate_tokens(text: str) -> int:
    """A model-independent over-estimate: a CJK character is about a token, other text about 4 characters."""
    cjk = len(_CJK.findall(text))
    return cjk + (len(text) - cjk + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


# The answer prompt's own text (ragline/prompts.toml: about 120 tokens), with room to spare.
PROMPT_TEXT_TOKENS = 200


def prompt_budget(settings: Settings) -> int:
    """Tokens an answer's prompt may fill besides its own text: what the model's context holds
    (RAGLINE_LLM_CONTEXT_TOKENS) once the answer (RAGLINE_LLM_MAX_TOKENS) has its room."""
    return max(0, settings.llm_context_tokens - settings.llm_max_tokens - PROMPT_TEXT_TOKENS)


# A question of this many tokens is never refused, whatever the settings: a small context configured by
# mistake shows in the model's errors, not as every chat message refused.
MIN_QUESTION_TOKENS = 64


def question_budget(settings: Settings) -> int:
    """The most a question may take: half the prompt's budget, so that the passages (or their summary) have
    the other half. A longer one could never be answered: the model would refuse every attempt."""
    return max(MIN_QUESTION_TOKENS, prompt_budget(settings) // 2)


def too_long_a_question(question: str, settings: Settings) -> str | None:
    """Why `question` is longer than the model's context can answer, or None."""
    tokens, most = estimate_tokens(question), question_budget(settings)
    if tokens <= most:
        return None
    return (f"the question is about {tokens} tokens, and the model's context (RAGLINE_LLM_CONTEXT_TOKENS = "
            f"{settings.llm_context_tokens}, of which RAGLINE_LLM_MAX_TOKENS = {settings.llm_max_tokens} for the "
            f"answer) leaves {most} for a question: shorten it (a CJK character counts as a token, other text "
            "about 4 characters)")


def too_long_a_goal(goal: str, settings: Settings) -> str | None:
    """Why an agent's `goal` is longer than the model's context can plan from, or None. Its prompt shows the
    goal twice (as the goal, and as the question last), beside the tools and what the agent finds: the goal
    gets the share a chat message gets, counted twice, so that the findings keep the other half."""
    tokens, most = estimate_tokens(goal), question_budget(settings) // 2
    if tokens <= most:
        return None
    return (f"the goal is about {tokens} tokens, and the model's context (RAGLINE_LLM_CONTEXT_TOKENS = "
            f"{settings.llm_context_tokens}, of which RAGLINE_LLM_MAX_TOKENS = {settings.llm_max_tokens} for the "
            f"reply) leaves {most} for a goal, which an agent's prompt shows twice beside what it finds: shorten it "
            "(a CJK character counts as a token, other text about 4 characters)")


class LoopGuard:
    """Watches a streamed reply for a loop, on its last LOOP_WINDOW characters, every LOOP_CHECK_EVERY."""

    def __init__(self) -> None:
        self._tail = ""
        self._unchecked = 0

    def looping(self, piece: str) -> bool:
        self._tail = (self._tail + piece)[-LOOP_WINDOW:]
        self._unchecked += len(piece)
        if self._unchecked < LOOP_CHECK_EVERY:
            return False
        self._unchecked = 0
        return cut_repetition(self._tail) is not None


@dataclass
class _Usage:
    headers: dict[str, str]
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def take(self, usage) -> None:
        if usage is not None:
            self.prompt_tokens, self.completion_tokens = usage.prompt_tokens or 0, usage.completion_tokens or 0


class ChatModel:
    def __init__(self, settings: Settings) -> None:
        self.model = settings.llm_model
        self.max_tokens = settings.llm_max_tokens
        self.constrained_tool_calls = settings.effective_llm_tool_calls == "schema"
        # A model on this machine shares its few cores, one or two generations at a time: a side step's reply
        # is read as a stream there, so that a step stopped meanwhile stops its generation (see `complete`).
        # A hosted one serves many at once, and a stream's pieces cost this worker CPU for nothing.
        self.whole_replies_streamed = settings.llm_is_local
        # RAGLINE_REDACT_PII with a model that is not local: what leaves the machine is masked.
        self._mask = redact_messages if settings.redact_pii and not settings.llm_is_local else (lambda m: m)
        self._client = AsyncOpenAI(base_url=settings.effective_llm_base_url, api_key=settings.llm_api_key or "unused",
                                   max_retries=0, timeout=settings.llm_timeout)

    @contextmanager
    def _observed(self, step: str) -> Iterator[_Usage]:
        """Every model call is counted, timed and its tokens added up (ragline_model_*), with the error's
        type (the provider client's exception, e.g. RateLimitError) when it fails."""
        started = time.monotonic()
        error_type = None
        # The model call's span (GenAI semantic conventions); the `openai` client's transport (httpx2)
        # is not instrumented, so the span is made here and its traceparent sent along.
        with _tracer.start_as_current_span(f"chat {self.model}", kind=trace.SpanKind.CLIENT, attributes={
                "gen_ai.operation.name": "chat", "gen_ai.request.model": self.model, "ragline.step": step}) as span:
            headers = {"X-Ragline-Step": step}
            if traceparent := tracing.current_traceparent():
                headers["traceparent"] = traceparent
            usage = _Usage(headers=headers)
            try:
                yield usage
            except BaseException as exc:
                # Stopped by our own side (the job cancelled, a sibling step failed, the worker stopping): a
                # call, but no error of the model's (RaglineModelErrorRate reads these as the provider's).
                if not isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
                    error_type = type(exc.__cause__ or exc).__name__
                    span.set_attribute("error.type", error_type)
                raise
            finally:
                span.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
                span.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
                metrics.model_call(step, self.model, time.monotonic() - started, prompt_tokens=usage.prompt_tokens,
                                   completion_tokens=usage.completion_tokens, error_type=error_type)

    async def complete(self, messages: list[dict], *, step: str, temperature: float = 0.0,
                       max_tokens: int | None = None, response_format: dict | None = None) -> Completion:
        """The whole reply. From a local model, read as a stream: a step stopped meanwhile (its job cancelled,
        a sibling failed) closes the connection, and llama.cpp's server stops generating; asked for in one
        piece, it generated to the end for nobody, holding the next calls behind it (minutes on a busy CPU)."""
        if not self.whole_replies_streamed:
            return await self._complete_in_one_piece(messages, step=step, temperature=temperature,
                                                     max_tokens=max_tokens, response_format=response_format)
        result = StreamedCompletion(model=self.model)
        async for _ in self.stream(messages, result, step=step, temperature=temperature, max_tokens=max_tokens,
                                   response_format=response_format):
            pass
        return Completion(text=result.text, model=result.model, prompt_tokens=result.prompt_tokens,
                          completion_tokens=result.completion_tokens, repetition_cut=result.repetition_cut)

    async def _complete_in_one_piece(self, messages: list[dict], *, step: str, temperature: float,
                                     max_tokens: int | None, response_format: dict | None) -> Completion:
        held_to = {"response_format": response_format} if response_format else {}
        with self._observed(step) as observed, translate_provider_errors(step):
            response = await self._client.chat.completions.create(
                model=self.model, messages=self._mask(messages), temperature=temperature,
                max_tokens=max_tokens or self.max_tokens, extra_headers=observed.headers, **held_to)
            observed.take(response.usage)
        if not response.choices:
            raise TransientError(f"{step}: the model returned no choices")
        usage = response.usage
        return Completion(text=response.choices[0].message.content or "", model=response.model or self.model,
                          prompt_tokens=usage.prompt_tokens if usage else 0,
                          completion_tokens=usage.completion_tokens if usage else 0)

    async def plan(self, messages: list[dict], tools: list[dict], *, step: str) -> ToolPlan:
        """One tool-calling turn: the model picks tools from `tools` (or answers in text)."""
        # Constrained, the reply is one call as JSON text, which tool_calls_in_text reads below.
        held_to = {"response_format": tool_call_format(tools)} if self.constrained_tool_calls else \
            {"tools": tools, "tool_choice": "auto"}
        with self._observed(step) as observed, translate_provider_errors(step):
            response = await self._client.chat.completions.create(
                model=self.model, messages=self._mask(messages), temperature=0.0, max_tokens=self.max_tokens,
                extra_headers=observed.headers, **held_to)
            observed.take(response.usage)
        if not response.choices:
            raise TransientError(f"{step}: the model returned no choices")
        message = response.choices[0].message
        calls = [ToolChoice(name=c.function.name, arguments=c.function.arguments or "{}")
                 for c in (message.tool_calls or []) if getattr(c, "function", None)]
        text = message.content or ""
        if not calls and (calls := tool_calls_in_text(text)):
            text = ""
        usage = response.usage
        return ToolPlan(text=text, calls=calls, model=response.model or self.model,
                        prompt_tokens=usage.prompt_tokens if usage else 0,
                        completion_tokens=usage.completion_tokens if usage else 0)

    async def stream(self, messages: list[dict], result: StreamedCompletion, *, step: str,
                     temperature: float = 0.0, max_tokens: int | None = None,
                     response_format: dict | None = None) -> AsyncIterator[str]:
        """Yields pieces of the reply as they arrive; totals land in `result`. A reply that falls into a
        loop (`cut_repetition`) is not read further: its stream is closed, so the model stops generating,
        and `result` keeps the text up to the loop's first occurrence, with `repetition_cut` set."""
        streamed_chars = 0
        finished = False
        guard = LoopGuard()
        with self._observed(step) as observed, translate_provider_errors(step):
            response = await self._client.chat.completions.create(
                model=self.model, messages=self._mask(messages), temperature=temperature,
                max_tokens=max_tokens or self.max_tokens, stream=True, stream_options={"include_usage": True},
                extra_headers=observed.headers, **({"response_format": response_format} if response_format else {}))
            async with response:  # closed however the reading ends (a loop, a cancelled job): the model stops
                async for chunk in response:
                    if chunk.model:
                        result.model = chunk.model
                    if chunk.usage:
                        result.prompt_tokens = chunk.usage.prompt_tokens
                        result.completion_tokens = chunk.usage.completion_tokens
                        observed.take(chunk.usage)
                    for choice in chunk.choices:
                        finished = finished or choice.finish_reason is not None
                        piece = choice.delta.content if choice.delta else None
                        if not piece:
                            continue
                        result.parts.append(piece)
                        streamed_chars += len(piece)
                        if guard.looping(piece) and (kept := cut_repetition(result.text)) is not None:
                            log.warning("the model repeated itself: reply cut", step=step, model=result.model,
                                        streamed_chars=streamed_chars, kept=kept[-200:])
                            result.parts, result.repetition_cut = [kept], True
                            break
                        yield piece
                    if result.repetition_cut:
                        break
            if not finished and not result.repetition_cut:
                # Ended, cleanly, before the model finished: a server that cut the stream (llama-cpp-python
                # does when another request arrives, unless started with --interrupt_requests False) or a
                # proxy. Taken as the answer, it would be a fragment shown as complete; retried, it is whole.
                raise TransientError(f"{step}: the reply's stream ended before the model finished it "
                                     f"({streamed_chars} characters in, no finish_reason)")
            if not result.completion_tokens:  # no usage came (the stream was cut): estimated, and counted so
                result.prompt_tokens = result.prompt_tokens or estimate_tokens(" ".join(str(m.get("content") or "") for m in messages))
                result.completion_tokens = max(1, streamed_chars // CHARS_PER_TOKEN)
                observed.prompt_tokens, observed.completion_tokens = result.prompt_tokens, result.completion_tokens

    async def close(self) -> None:
        await self._client.close()
