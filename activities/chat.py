"""The chat chain's activities: retrieve_context -> generate_answer (streams) -> summarize_context ||
extract_entities. Each makes at most one kind of model call; the answer never waits for side steps."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import re
from datetime import datetime, timedelta, timezone

import structlog
from temporalio import activity
from temporalio.contrib.workflow_streams import WorkflowStreamClient
from temporalio.service import RPCError, RPCStatusCode

from activities.heartbeats import heartbeating
from activities.search import find_passages_for_turn, no_documents_warnings
from models.chat import (
    CacheInput, CacheOutput, Citation, ContextInput, EntitiesOutput, Entity, GenerateInput, GenerateOutput,
    RetrieveInput, RetrieveOutput, SummaryOutput, TurnResult, Usage,
)
from models.ingest import SearchHit
from ragline import answer_cache, lexical, prompts, relevance, tracing
from ragline.answer_cache import AnswerCache
from ragline.blobstore import BlobStore
from ragline.embeddings import Embedder
from ragline.errors import InputError
from ragline.llm import (
    ChatModel, StreamedCompletion, estimate_tokens, json_array_format, prompt_budget, too_long_a_question,
)
from ragline.settings import Settings
from ragline.vectorstore import VectorIndex
from temporal import policies
from temporal.errors import translate_errors
from models.jobs import EVENTS_TOPIC

log = structlog.get_logger("ragline.chat")

ENTITY_TYPES = {"PERSON", "ORG", "PLACE", "DATE", "PRODUCT", "OTHER"}
MAX_ENTITIES = 10
ENTITIES_FORMAT = json_array_format({
    "type": "object", "required": ["text", "type"], "additionalProperties": False,
    "properties": {"text": {"type": "string", "minLength": 1, "maxLength": 100},
                   "type": {"enum": sorted(ENTITY_TYPES)}}}, max_items=MAX_ENTITIES)
_CITATION = re.compile(r"\[(\d{1,2})\]")
_CITATION_MARK = re.compile(r"\[\d*\]?")  # a citation mark, or one cut off ("[1")
_PASSAGE_HEAD = re.compile(r"\([^()]*, page \d+\)")  # "(zh.md, page 1)", as the prompt heads each passage
_NOT_WORDS = re.compile(r"[\W_]+")
# Content words: numbers, runs of 4+ letters outside CJK, and every overlapping pair of CJK
# characters (Chinese has no spaces, so bigrams stand in for words).
_WORD = re.compile(r"\d+(?:[.,]\d+)*|[^\W\d_\u4e00-\u9fff]{4,}|(?=([\u4e00-\u9fff]{2}))", re.UNICODE)
# A sentence ends at . ! ? 。！？ (and the quote marks or brackets closing it) or a newline; the dot or comma
# between two digits is inside it: a quote cut at "2.5" misstated the number it quoted.
_SENTENCE = re.compile(r"(?:[^.!?。！？\n]|(?<=\d)[.,](?=\d))+[.!?。！？]*[\"'”’)\]」』]*")
QUOTE_CHARS = 300
# An uncited answer is attributed to the passages sharing at least this share of its content words.
SUPPORT_THRESHOLD = 0.35
# Room kept in the answer's prompt for the recent turns when deciding whether the passages fit beside the
# question (history beyond what is left when the prompt is built is dropped, oldest first).
HISTORY_ROOM_TOKENS = 400
DELTA_FLUSH = timedelta(milliseconds=150)
# A reply of citation markers only is quoted in its warning up to this length.
NO_ANSWER_SHOWN_CHARS = 40
REPETITION_WARNING = "the model repeated itself: its answer was cut where the repetition began"


def passages_that_fit(passages: list[SearchHit], question: str, settings: Settings) -> list[SearchHit]:
    """The best passages (they come best first) that fit the model's context with the question, at least the
    first. The summary and the entities of a turn whose passages overflow the context would otherwise send
    them all: a prompt over the context is refused by the model (a 400, not retried), and the turn failed."""
    room = prompt_budget(settings) - estimate_tokens(question)
    kept = passages[:1]
    for passage in passages[1:]:
        if estimate_tokens(prompts.format_passages([*kept, passage])) > room:
            break
        kept.append(passage)
    if len(kept) < len(passages):
        log.info("passages over the model's context left out", kept=len(kept), left_out=len(passages) - len(kept))
    return kept


def recent_turns(history: list, room: int) -> list[str]:  # noqa: ANN001 - HistoryItem
    """The most recent turns, as the prompt shows them, that fit in `room` tokens together: a conversation
    in Chinese (a token a character) overflowed a 4,096-token context with four long turns. The latest turn is
    always there, its end cut if it alone is too long: a follow-up ("and who approves it?") needs it."""
    kept: list[str] = []
    for turn in reversed(history):
        shown = f"Q: {turn.question}\nA: {turn.answer}"
        tokens = estimate_tokens(shown) + 1
        if tokens > room:
            if not kept and room > 0:
                kept.append(_cut_to(shown, room))
            break
        room -= tokens
        kept.append(shown)
    return kept[::-1]


def _cut_to(text: str, tokens: int) -> str:
    """`text`'s beginning, at most `tokens` tokens of it (by estimate_tokens), ending in "…"."""
    keep = len(text) * tokens // max(1, estimate_tokens(text))
    while keep > 0 and estimate_tokens(text[:keep]) + 1 > tokens:
        keep -= max(1, keep // 20)
    return text[:max(0, keep)].rstrip() + "…"


class ChatActivities:
    def __init__(self, settings: Settings, blobs: BlobStore, embedder: Embedder, index: VectorIndex,
                 model: ChatModel, cache: AnswerCache | None = None, fallback: ChatModel | None = None) -> None:
        self.settings = settings
        self.blobs = blobs
        self.embedder = embedder
        self.index = index
        self.model = model
        self.cache = cache or AnswerCache(settings.answer_cache_size)
        self.fallback = fallback

    @activity.defn
    @translate_errors
    def retrieve_context(self, req: RetrieveInput) -> RetrieveOutput:
        """Retrieval, the relevance gate and the answer cache in one step: the answer waits for nothing else."""
        attempt = activity.info().attempt
        if (too_long := too_long_a_question(req.question, self.settings)) is not None:
            raise InputError(too_long)  # refused by the API since; a turn accepted before, or by other settings
        key = None
        # No cache (RAGLINE_ANSWER_CACHE_SIZE=0): no key either, so the turn runs no cache_answer step.
        if req.use_cache and self.cache.size > 0:
            key = answer_cache.cache_key(req.tenant, req.collection, self.index.version(req.tenant, req.collection),
                                         req.question, req.top_k)
            hit = self.cache.get(key)
            answer_cache.record_lookup(hit is not None, req.collection)
            if hit is not None:
                return RetrieveOutput(context_ref=self.blobs.put_json([]), passages=0, citations=[], cache_key=key,
                                      cached=TurnResult.model_validate(hit), attempt=attempt)
        threshold = relevance.threshold(self.settings.relevance_threshold)
        hits = find_passages_for_turn(self.embedder, self.index, req.tenant, req.collection, req.question, req.top_k,
                                      threshold=threshold, follows=req.follows)
        supported = any(h.relevance >= threshold for h in hits)
        if not supported:  # nothing to answer from: say so, in the question's language, without a model
            # A collection without the tenant's documents (a misspelt name?) is told from one that does not
            # cover the question. That refusal gets no cache key: documents may come a second later.
            if warnings := no_documents_warnings(self.index, req.tenant, req.collection, hits):
                return RetrieveOutput(context_ref=self.blobs.put_json([]), passages=0, citations=[], supported=False,
                                      refusal=prompts.no_documents_answer(req.question, req.collection),
                                      warnings=warnings, attempt=attempt)
            refusal = prompts.not_covered_answer(req.question) if hits else prompts.no_context_answer(req.question)
            return RetrieveOutput(context_ref=self.blobs.put_json([]), passages=0, citations=[], supported=False,
                                  refusal=refusal, cache_key=key, attempt=attempt)
        prompt = estimate_tokens(" ".join(h.text for h in hits)) + estimate_tokens(req.question) + HISTORY_ROOM_TOKENS
        return RetrieveOutput(
            context_ref=self.blobs.put_json([h.model_dump() for h in hits]), passages=len(hits),
            citations=[citation(h) for h in hits], cache_key=key,
            fits=prompt <= prompt_budget(self.settings), attempt=attempt)

    @activity.defn
    @translate_errors
    def cache_answer(self, req: CacheInput) -> CacheOutput:
        """Keep a finished turn's answer for the same question on the same collection version."""
        self.cache.put(req.key, req.result.model_dump(mode="json"))
        return CacheOutput(stored=True, attempt=activity.info().attempt)

    def _beat(self) -> timedelta:
        """How often a model call beats: soon on few model slots, where a side step may be told to step aside."""
        return policies.model_call_beat(self.settings.effective_llm_concurrency)

    def _passages(self, context_ref: str) -> list[SearchHit]:
        return [SearchHit.model_validate(p) for p in self.blobs.get_json(context_ref)]

    @activity.defn
    @translate_errors
    async def generate_answer(self, req: GenerateInput) -> GenerateOutput:
        return await self._generate(req, self.model)

    @activity.defn
    @translate_errors
    async def generate_answer_fallback(self, req: GenerateInput) -> GenerateOutput:
        """The same answer from the lighter fallback model (RAGLINE_FALLBACK_LLM_*), after generate_answer
        exhausted its retries on a retryable error."""
        if self.fallback is None:
            raise InputError("no fallback model is configured (RAGLINE_FALLBACK_LLM_BASE_URL)")
        return await self._generate(req, self.fallback)

    async def _generate(self, req: GenerateInput, model: ChatModel) -> GenerateOutput:
        answered = await self._stream_answer(req, model)
        return answered.model_copy(update={"model_slots": self.settings.effective_llm_concurrency})

    async def _stream_answer(self, req: GenerateInput, model: ChatModel) -> GenerateOutput:
        passages = await asyncio.to_thread(self._passages, req.context_ref)
        attempt = activity.info().attempt
        if not passages:
            return GenerateOutput(answer=prompts.no_context_answer(req.question), cited=[], model="none",
                                  attempt=attempt)
        context = prompts.format_passages(passages)
        if req.summary:  # the passages did not fit the context: answer from their summary, still citable
            context = f"SUMMARY OF THE PASSAGES: {req.summary}\n\n{prompts.format_passage_heads(passages)}"
        room = prompt_budget(self.settings) - estimate_tokens(context) - estimate_tokens(req.question)
        history = "\n".join(recent_turns(req.history, room)) or "(none)"
        messages = prompts.messages("answer", passages=context, history=history, question=req.question)
        result = StreamedCompletion(model=model.model)
        echo = EchoedTurn(req.question)
        async with heartbeating(every=self._beat()), \
                AnswerDeltas(req.attempts_before + attempt, send=req.stream) as deltas:
            async for piece in model.stream(messages, result, step="generate"):
                if shown := echo.feed(piece):
                    await deltas.publish(shown)
            if rest := echo.end():
                await deltas.publish(rest)
        # A looping reply was stopped and cut by the stream: the deltas sent showed part of the loop, the
        # answer (and `ragline.answer.completed`) is the cut text.
        warnings = [REPETITION_WARNING] if result.repetition_cut else []
        usage = Usage(prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens)
        answer = EchoedTurn.strip(req.question, result.text).strip()
        if (no_answer := no_answer_warning(answer, req.question)) is not None:
            log.warning("the model's answer has no words of its own", reply=answer[:200])
            return GenerateOutput(answer=prompts.no_answer(req.question), cited=[], grounded=False, answered=False,
                                  model=result.model, usage=usage, warnings=[*warnings, no_answer],
                                  unsent_events=deltas.unsent, attempt=attempt)
        cited = cited_passages(answer, passages)
        return GenerateOutput(answer=answer, cited=cited, grounded=bool(cited),
                              citations=distinct([citation(passages[i - 1], quote_for(answer, passages[i - 1].text))
                                                  for i in cited]),
                              model=result.model, usage=usage, warnings=warnings, unsent_events=deltas.unsent,
                              attempt=attempt)

    @activity.defn
    @translate_errors
    async def summarize_context(self, req: ContextInput) -> SummaryOutput:
        passages = passages_that_fit(await asyncio.to_thread(self._passages, req.context_ref), req.question,
                                     self.settings)
        if not passages:
            return SummaryOutput(summary="", attempt=activity.info().attempt)
        async with heartbeating(every=self._beat()):
            reply = await self.model.complete(prompts.messages(
                "summarize", opens_alike=not req.before_answer, passages=prompts.format_passages(passages),
                question=req.question), step="summarize")
        return SummaryOutput(summary=reply.text.strip(), attempt=activity.info().attempt,
                             usage=Usage(prompt_tokens=reply.prompt_tokens, completion_tokens=reply.completion_tokens))

    @activity.defn
    @translate_errors
    async def extract_entities(self, req: ContextInput) -> EntitiesOutput:
        passages = passages_that_fit(await asyncio.to_thread(self._passages, req.context_ref), req.question,
                                     self.settings)
        if not passages:
            return EntitiesOutput(entities=[], attempt=activity.info().attempt)
        messages = prompts.messages("extract_entities", passages=prompts.format_passages(passages),
                                    question=req.question)
        # A server that takes JSON schemas (llama.cpp: RAGLINE_LLM_TOOL_CALLS=schema) holds the reply to the array.
        held = {"response_format": ENTITIES_FORMAT} if self.model.constrained_tool_calls else {}
        async with heartbeating(every=self._beat()):
            reply = await self.model.complete(messages, step="extract_entities", **held)
            usage = Usage(prompt_tokens=reply.prompt_tokens, completion_tokens=reply.completion_tokens)
            entities = parse_entities(reply.text)
            if entities is None:  # one corrective re-ask, then give up gracefully
                messages += [{"role": "assistant", "content": reply.text},
                             {"role": "user", "content": prompts.text("extract_entities", "repair")}]
                reply = await self.model.complete(messages, step="extract_entities", **held)
                usage = usage + Usage(prompt_tokens=reply.prompt_tokens, completion_tokens=reply.completion_tokens)
                entities = parse_entities(reply.text)
        warnings = []
        if entities is None:
            warnings.append("entity extraction returned invalid JSON twice; continuing without entities")
            log.warning("entities unparseable", reply=reply.text[:200])
            entities = []
        return EntitiesOutput(entities=entities, warnings=warnings, usage=usage, attempt=activity.info().attempt)


class AnswerDeltas:
    """Publishes pieces of the answer to the job's event stream. The first piece goes out at once (a
    person waits for it); later ones in batches, every DELTA_FLUSH. The batch still unsent when the
    answer is complete stays in `unsent`: it goes back with the activity's result and the job publishes
    it, which saves a signal and a read of the stream. An attempt that fails sends everything, so its
    partial answer shows before the next attempt's."""

    def __init__(self, attempt: int, *, send: bool = True) -> None:
        self.attempt = attempt
        self.send = send  # False: an answer a reviewer may hold is not shown while it comes
        self.index = 0
        self.unsent: list[dict] = []
        self._stream = WorkflowStreamClient.from_within_activity()
        self._topic = self._stream.topic(EVENTS_TOPIC)
        self._sender: asyncio.Task | None = None
        self._job_ended = False

    async def __aenter__(self) -> "AnswerDeltas":
        return self

    async def __aexit__(self, exc_type, *_exc) -> None:
        if self._sender is not None:
            self._sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sender
        if exc_type is not None:
            self._hand_over()
        await self._send()  # what was handed over goes out before the result

    async def publish(self, piece: str) -> None:
        if not self.send:
            return
        info = activity.info()
        now = datetime.now(timezone.utc)
        self.index += 1
        traceparent = tracing.current_traceparent()  # the attempt's span: same trace as the job's events
        self.unsent.append({
            **({"traceparent": traceparent} if traceparent else {}),
            # The attempt numbers on across an operator's retry and the fallback (GenerateInput.attempts_before).
            "specversion": "1.0", "id": f"{info.workflow_id}/answer/{info.activity_id}/{self.attempt}/{self.index}",
            "source": "ragline/generate_answer", "type": "ragline.answer.delta", "time": now.isoformat(),
            "subject": info.workflow_id, "datacontenttype": "application/json",
            "data": {"text": piece, "index": self.index, "attempt": self.attempt},
        })
        if self.index == 1:
            self._hand_over()
            await self._send()
            self._sender = asyncio.create_task(self._send_batches())

    def _hand_over(self) -> None:
        for event in self.unsent:
            self._topic.publish(event)
        self.unsent = []

    async def _send_batches(self) -> None:
        while not self._job_ended:
            await asyncio.sleep(DELTA_FLUSH.total_seconds())
            if self.unsent:
                self._hand_over()
                await self._send()

    async def _send(self) -> None:
        """Send what was handed over. A batch that cannot go yet stays with the stream client, which sends
        it with the next one; once the job has ended (cancelled, terminated) nobody reads its stream, and
        the attempt itself is cancelled by its next heartbeat."""
        if self._job_ended:
            return
        try:
            await self._stream.flush()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                log.warning("answer deltas not sent yet", error=str(exc))
                return
            log.info("answer deltas dropped: the job has ended", error=str(exc))
            self._job_ended = True


def distinct(citations: list[Citation]) -> list[Citation]:
    """One citation per quoted sentence of a document's page, or of adjacent chunks: chunks overlap
    (RAGLINE_CHUNK_OVERLAP), and an answer citing both showed the same sentence twice, with two pages when the
    overlap crossed a page break (a chunk carries the page it begins on). A header repeated on pages further
    apart stays."""
    kept: list[Citation] = []
    for c in citations:
        if not c.quote or not any(k.document_id == c.document_id and k.quote == c.quote and
                                  (k.page == c.page or _adjacent(k, c)) for k in kept):
            kept.append(c)
    return kept


def _adjacent(a: Citation, b: Citation) -> bool:
    ends = [c.chunk_id.rsplit(":", 1)[-1] for c in (a, b)]
    return all(e.isdigit() for e in ends) and abs(int(ends[0]) - int(ends[1])) <= 1


def citation(hit: SearchHit, quote: str = "") -> Citation:
    return Citation(document_id=hit.document_id, filename=hit.filename, page=hit.page,
                    chunk_id=f"{hit.document_id}:{hit.chunk}", score=round(hit.score, 4),
                    relevance=hit.relevance, quote=quote or hit.text[:QUOTE_CHARS].strip())


def quote_for(answer: str, passage: str) -> str:
    """The sentence of the passage that shares the most words with the answer (the quoted span)."""
    words = content_words(answer)
    sentences = [s.strip() for s in _SENTENCE.findall(passage) if s.strip()]
    if not sentences:
        return passage[:QUOTE_CHARS].strip()
    best = max(sentences, key=lambda s: len(words & content_words(s)))
    return best[:QUOTE_CHARS]


def parse_entities(text: str) -> list[Entity] | None:
    """Parse the model's JSON, repairing the usual damage (code fences, prose around it, trailing commas,
    single quotes). None when nothing usable is left."""
    cleaned = re.sub(r"^```(?:json)?|```$", "", text.strip(), flags=re.MULTILINE).strip()
    data = _first_list(cleaned)
    if not isinstance(data, list):
        return None
    if data and not any(isinstance(item, dict) for item in data):
        return None  # a list of something else (a small model's "[1]"): not "no entities", nothing usable
    entities, seen = [], set()
    for item in data:
        if isinstance(item, dict) and isinstance(item.get("text"), str) and item["text"].strip():
            kind = str(item.get("type", "OTHER")).upper()
            key = item["text"].strip().lower()
            if key not in seen:
                seen.add(key)
                entities.append(Entity(text=item["text"].strip(), type=kind if kind in ENTITY_TYPES else "OTHER"))
    return entities[:MAX_ENTITIES]


def _first_list(text: str) -> list | None:
    """The first bracketed list in `text` that parses: as JSON, without trailing commas, or as a
    Python literal (single quotes, apostrophes inside double quotes). Text after it is ignored."""
    start = text.find("[")
    if start == -1:
        return None
    ends = [i for i, ch in enumerate(text) if ch == "]" and i > start]
    for end in ends:
        segment = text[start:end + 1]
        without_commas = re.sub(r",\s*([\]}])", r"\1", segment)
        for parse in (json.loads, lambda s: json.loads(without_commas), ast.literal_eval):
            try:
                data = parse(segment)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                continue
            if isinstance(data, list):
                return data
    return None


def content_words(text: str) -> set[str]:
    return {(m.group(1) or m.group(0)).lower() for m in _WORD.finditer(text) if m.group(1) or m.group(0)}


def cited_passages(answer: str, passages: list[SearchHit]) -> list[int]:
    """Passages the answer cites as [n] and that bear it out; for an answer without such markers, those
    that share enough of its words.

    A marker alone is no proof: a small model cites [1] and says something else (the 0.5B default once
    answered "45 seconds [1]", a prompt's example, for an expiry date). A cited passage in the answer's
    own language must share one of the answer's content words; across languages words cannot be
    compared, and the marker stands."""
    words = content_words(_CITATION.sub(" ", answer))
    numbers = marked_passages(answer, len(passages))
    credible = [n for n in numbers if _bears_out(answer, words, passages[n - 1].text)]
    if credible or not words:
        return credible
    supported = []
    for i, passage in enumerate(passages, 1):
        overlap = len(words & content_words(passage.text)) / len(words)
        if overlap >= SUPPORT_THRESHOLD:
            supported.append(i)
    return supported


def marked_passages(answer: str, count: int) -> list[int]:
    """The 1-based passage numbers the answer's [n] markers name, each once, smallest first; a number beyond
    the `count` passages names none."""
    return sorted({int(n) for n in _CITATION.findall(answer) if 1 <= int(n) <= count})


class EchoedTurn:
    """The prompt shows earlier turns as "Q: …\nA: …", and a small model may answer in that form, opening with
    the question ("Q: 那么每天的餐补是多少？\nA: 120 元"): the person saw the question echoed, and its words took
    the answer's overlap with the passage it came from below the support line (no citation). A reply that opens
    with "Q:" is held back while it comes, and what follows its "\nA:" is the answer. Fed the whole reply at
    once, it gives what it gives fed piece by piece: the final answer is the streamed one."""

    _OPENS = re.compile(r"\s*Q[:：]")
    _ANSWER_MARK = re.compile(r"\n\s*A[:：]")  # (the spaces after it are dropped as they come)

    def __init__(self, question: str) -> None:
        self._held = ""
        self._passing = False
        self._after_mark = False  # the answer follows an echo's "A:": its first spaces are the mark's
        # Past this with no "A:", the reply is no echoed turn: it is shown (a long question is not echoed whole).
        self._limit = min(len(question), 600) + 200

    @classmethod
    def strip(cls, question: str, reply: str) -> str:
        echo = cls(question)
        return echo.feed(reply) + echo.end()

    def feed(self, piece: str) -> str:
        """What of the reply may be shown now."""
        if self._passing:
            if self._after_mark:
                piece = piece.lstrip(" \t")
                self._after_mark = not piece
            return piece
        self._held += piece
        opening = self._held.lstrip()
        if opening in ("", "Q") and len(self._held) <= self._limit:
            return ""  # too little to tell yet (any other first letter goes out at once: the first delta waits)
        if self._OPENS.match(self._held):
            if (mark := self._ANSWER_MARK.search(self._held)) is not None and mark.end() <= self._limit:
                self._after_mark = True
                return self._let_through(self._held[mark.end():])
            if len(self._held) <= self._limit:
                return ""
        return self._let_through(self._held)

    def end(self) -> str:
        """What is still held when the reply is complete: shown as it came."""
        return "" if self._passing else self._let_through(self._held)

    def _let_through(self, text: str) -> str:
        self._passing, self._held = True, ""
        return self.feed(text) if text else ""


def no_answer_warning(reply: str, question: str = "") -> str | None:
    """The warning for a reply with no words of its own ("", "[1] [2]", "[1"), or with the question's words
    only ("[1] (zh.md, page 1) 那由谁审批？" for "那由谁审批？"), which is no answer: it says what the model gave
    instead, since "unverified" would suggest there was an answer to check. None for a reply with words."""
    shown = reply if len(reply) <= NO_ANSWER_SHOWN_CHARS else reply[:NO_ANSWER_SHOWN_CHARS] + "…"
    words = _NOT_WORDS.sub("", _PASSAGE_HEAD.sub("", _CITATION_MARK.sub("", reply))).casefold()
    if words:
        if words == _NOT_WORDS.sub("", question).casefold():
            return prompts.text("no_answer", "echo_warning").format(reply=shown)
        return None
    if _CITATION_MARK.search(reply):
        return prompts.text("no_answer", "markers_warning").format(reply=shown)
    return prompts.text("no_answer", "no_words_warning")


def _bears_out(answer: str, words: set[str], passage: str) -> bool:
    return not words or lexical.language(answer) != lexical.language(passage) or bool(words & content_words(passage))
