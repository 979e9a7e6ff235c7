"""A scripted, deterministic OpenAI-compatible HTTP server for tests and benchmarks.

It speaks enough of the OpenAI HTTP API (chat completions, streaming included; embeddings; models)
that the real `openai` client code path is exercised end to end, and it can inject faults
(429 with Retry-After, 503, dropped connections, hangs, malformed bodies) on demand or at random.

In-process (tests)::

    llm = ScriptedLLM()
    await llm.start()            # uvicorn on 127.0.0.1, free port, task in the running loop
    client = AsyncOpenAI(base_url=llm.base_url, api_key="x", max_retries=0, timeout=5)
    llm.script("answer", ["first reply", "429", {"tool_calls": [{"name": "search", "arguments": {"q": "x"}}]}])
    ...
    assert llm.count("answer", ok_only=True) == 1
    await llm.stop()

Tests sharing one server keep out of each other's way with a scope: a unique token the test puts in
its question (or goal, or document text). The scope's scripts, delays and records apply only to
requests whose messages contain the token; every other request is answered as if it did not exist::

    with llm.scope() as mine:              # mine.token is e.g. "tok3f9a1c2b"; put it in the question
        mine.script("answer", ["503"] * 4)
        mine.set_delay(0.2)
        ...
        assert mine.count("answer", ok_only=True) == 1
    # leaving the block removes whatever of its script was not used

As a process (benchmarks)::

    python -m devtools.scripted_llm --port 8999 --delay 5

then tune it with `POST /_control` (same knobs as `ScriptedLLM.configure`) and read `GET /_stats`.

Which step a chat request belongs to is read from a `TASK: <name>` line in the system message
(`answer`, `agent`; no marker -> `answer`), or from Ragline's `X-Ragline-Step` header for `summarize` and
`extract_entities`, whose prompts open like the answer's. The user message holds
numbered passages `[1] (file.pdf, page 3) text...` and the question after a line starting `QUESTION:`.
Embedding requests are recorded under the task `embeddings`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import inspect
import json
import math
import random
import re
import signal
import socket
import struct
import sys
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

FAULT_KINDS: tuple[str, ...] = ("429", "503", "drop", "hang", "malformed")
# Faults only a script asks for (random faults keep to FAULT_KINDS): "cut" ends a stream after its first
# piece with [DONE] and no finish_reason, as llama-cpp-python's server does to a stream when another request
# arrives (its interrupt_requests, on by default).
SCRIPTED_FAULTS: tuple[str, ...] = ("cut",)
EMBED_DIM = 384
MODEL_ID = "scripted"
EMBEDDINGS_TASK = "embeddings"
ANY_TASK = "*"
NO_ANSWER_EN = "I don't know: the documents do not contain the answer."
NO_ANSWER_ZH = "我不知道：文档中没有答案。"

_TRANSPORT_KEY = "scripted_llm.transport"
_STATUS_FAULT = re.compile(r"[45]\d\d")
_TASK_RE = re.compile(r"^\s*TASK:\s*([A-Za-z0-9_.\-]+)", re.M)
_PASSAGE_RE = re.compile(r"^\s*\[(\d+)\]\s*(?:\(([^)]*)\)\s*)?(.*)$")
_HEADER_RE = re.compile(r"^\s*([A-Z][A-Z _]{2,}):\s*(.*)$")
_SENTENCE_RE = re.compile(r"^(.+?(?:[.!?](?=[\s\"')\]]|$)|[。！？]))", re.S)
_CJK_RE = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af]")
_CAP_WORD_RE = re.compile(r"\b[A-Z][A-Za-z0-9]*(?:[-'][A-Za-z0-9]+)*\b")
_ENTITY_STOPWORDS = frozenset("""
    A An And As At But By For From He Her His How I If In Into Is It Its Me My No Not Of On Or Our She So
    That The Their Them Then There These They This Those To Us We What When Where Which While Who Why With
    You Your Yes Also All Any Each Every Some Many Most More One Two Three After Before During Here Page
""".split())
_DATE_WORDS = frozenset("""
    January February March April May June July August September October November December
    Monday Tuesday Wednesday Thursday Friday Saturday Sunday
""".split())
_MAX_SENTENCE = 500


# --------------------------------------------------------------------------------------------------
# Reading the request


def message_text(content: Any) -> str:
    """The text of a message `content`, which may be a string or a list of content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return str(content)


# Ragline's summary and entities open like its answer, its system prompt ("TASK: answer") included, and name
# their own task after the passages: the step header Ragline sends with every call tells them apart.
_STEP_TASKS = {"summarize": "summarize", "extract_entities": "extract_entities"}


def detect_task(messages: list[dict], step: str | None = None) -> str:
    """The task of Ragline's step header `step` for the steps that share the answer's system prompt, else
    the `TASK: <name>` marker of the system (or developer) message; "answer" when there is none."""
    if step in _STEP_TASKS:
        return _STEP_TASKS[step]
    for m in messages:
        if isinstance(m, dict) and m.get("role") in ("system", "developer"):
            found = _TASK_RE.search(message_text(m.get("content")))
            if found:
                return found.group(1)
    return "answer"


def last_user_message(messages: list[dict]) -> str:
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role") == "user":
            return message_text(m.get("content"))
    return ""


@dataclass
class Passage:
    number: int
    source: str
    text: str


def parse_prompt(user_text: str) -> tuple[list[Passage], str | None]:
    """Numbered passages `[n] (source) text` and the question after `QUESTION:` (None if absent)."""
    passages: list[Passage] = []
    question: list[str] | None = None
    mode = None  # "passage" | "question" | None
    for line in user_text.splitlines():
        p = _PASSAGE_RE.match(line)
        if p:
            passages.append(Passage(int(p.group(1)), (p.group(2) or "").strip(), p.group(3).strip()))
            mode = "passage"
            continue
        h = _HEADER_RE.match(line)
        if h:
            if h.group(1).strip() == "QUESTION":
                question = [h.group(2)] if question is None else question + [h.group(2)]
                mode = "question"
            else:
                mode = None
            continue
        if mode == "passage" and line.strip():
            passages[-1].text = f"{passages[-1].text} {line.strip()}".strip()
        elif mode == "question":
            question.append(line)  # type: ignore[union-attr]
    passages.sort(key=lambda x: x.number)
    return passages, ("\n".join(question).strip() if question is not None else None)


def first_sentence(text: str) -> str:
    flat = " ".join(text.split())
    found = _SENTENCE_RE.match(flat)
    sentence = (found.group(1) if found else flat).strip()
    if len(sentence) > _MAX_SENTENCE:
        sentence = sentence[:_MAX_SENTENCE].rsplit(" ", 1)[0]
    return sentence


def has_cjk(text: str) -> bool:
    return bool(_CJK_RE.search(text or ""))


def extract_entities(text: str, limit: int = 5) -> list[dict]:
    seen: list[str] = []
    for word in _CAP_WORD_RE.findall(text):
        word = word[:-2] if word.endswith("'s") else word
        if len(word) < 2 or word in _ENTITY_STOPWORDS or word in seen:
            continue
        seen.append(word)
        if len(seen) == limit:
            break
    return [{"text": w, "type": "DATE" if w in _DATE_WORDS else "ORG"} for w in seen]


def default_reply(task: str, body: dict) -> str | dict:
    """The deterministic reply for a chat request nobody scripted."""
    messages = body.get("messages") or []
    user = last_user_message(messages)
    passages, question = parse_prompt(user)
    forced = _forced_tool_call(body, question if question is not None else user)
    if forced is not None:
        return forced
    if task == "summarize":
        return f"Summary: {first_sentence(passages[0].text)}" if passages else "Summary: no context."
    if task == "extract_entities":
        context = " ".join(p.text for p in passages)
        return json.dumps(extract_entities(context), ensure_ascii=False)
    # "answer", "agent" and anything else
    if passages:
        return f"According to [1], {first_sentence(passages[0].text)}"
    return NO_ANSWER_ZH if has_cjk(question if question is not None else user) else NO_ANSWER_EN


def _forced_tool_call(body: dict, question: str) -> dict | None:
    """If the request forces a tool (`tool_choice` "required" or a named function), call it with arguments
    filled from its JSON schema (required string parameters get the question)."""
    tools = [t for t in body.get("tools") or [] if isinstance(t, dict) and t.get("type", "function") == "function"]
    choice = body.get("tool_choice")
    if not tools or choice in (None, "auto", "none"):
        return None
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        tool = next((t for t in tools if (t.get("function") or {}).get("name") == name), None)
        if tool is None:
            return None
    elif choice == "required":
        tool = tools[0]
    else:
        return None
    fn = tool.get("function") or {}
    schema = fn.get("parameters") or {}
    props = schema.get("properties") or {}
    args: dict[str, Any] = {}
    for key in schema.get("required") or []:
        kind = (props.get(key) or {}).get("type", "string")
        args[key] = {"string": question, "integer": 1, "number": 1, "boolean": True,
                     "array": [], "object": {}}.get(kind, question)
    return {"tool_calls": [{"name": fn.get("name", "tool"), "arguments": args}]}


# --------------------------------------------------------------------------------------------------
# Replies, faults, records


def is_fault(item: Any) -> bool:
    return isinstance(item, str) and (item in FAULT_KINDS or item in SCRIPTED_FAULTS
                                      or bool(_STATUS_FAULT.fullmatch(item)))


@dataclass
class Reply:
    content: str | None = None
    tool_calls: list[dict] | None = None
    fault: str | None = None
    delay: float = 0.0

    @classmethod
    def of(cls, item: Any) -> Reply | None:
        """A reply item: a content string, a fault name, or a dict with `content` / `tool_calls` / `fault`
        (and an optional extra `delay` in seconds). None means "use the default"."""
        if item is None or isinstance(item, Reply):
            return item
        if isinstance(item, str):
            return cls(fault=item) if is_fault(item) else cls(content=item)
        if isinstance(item, dict):
            fault = item.get("fault")
            if fault is not None and not is_fault(str(fault)):
                raise ValueError(f"unknown fault {fault!r}; expected one of {FAULT_KINDS} or a 4xx/5xx status")
            return cls(content=item.get("content"), tool_calls=item.get("tool_calls"),
                       fault=str(fault) if fault is not None else None, delay=float(item.get("delay") or 0))
        raise TypeError(f"a scripted reply must be a string or a dict, not {type(item).__name__}")

    def text(self) -> str:
        if self.tool_calls:
            return json.dumps(self.tool_calls, ensure_ascii=False)
        return self.content or ""


@dataclass
class CallRecord:
    """One request the server received. Readable as attributes or as a mapping (`rec["task"]`)."""

    id: int
    endpoint: str  # "chat" | "embeddings"
    task: str
    stream: bool
    model: str | None
    started_at: float  # time.monotonic()
    finished_at: float | None = None
    status: int | None = None  # HTTP status sent; None for drop / hang / a client that went away
    fault: str | None = None  # the fault injected, if any
    scripted: bool = False  # the reply came from script()/script_fn()
    reply: str | None = None  # the content (or tool calls as JSON) that was sent
    user_message: str = ""
    question: str = ""  # text after `QUESTION:` (the whole last user message if there is none)
    step: str | None = None  # X-Ragline-Step header
    idempotency_key: str | None = None  # Idempotency-Key header
    client_disconnected: bool = False
    scope: str | None = None  # token of the first scope whose token the request contains
    text: str = field(default="", repr=False)  # every message's text (embeddings: the inputs), for matching
    headers: dict[str, str] = field(default_factory=dict, repr=False)
    request: dict = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.fault is None and not self.client_disconnected

    @property
    def cut_off(self) -> bool:
        """The client went away (a killed worker, a timeout) before the whole reply was sent, without the
        server injecting a fault: the request was interrupted from the client's side."""
        return self.client_disconnected and self.fault is None

    def contains(self, token: str) -> bool:
        return token in self.text

    @property
    def duration(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.started_at

    def overlaps(self, other: CallRecord) -> bool:
        end_a = self.finished_at if self.finished_at is not None else math.inf
        end_b = other.finished_at if other.finished_at is not None else math.inf
        return self.started_at < end_b and other.started_at < end_a

    def __getitem__(self, key: str) -> Any:
        if key in _RECORD_KEYS or key in ("ok", "duration"):
            return getattr(self, key)
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def as_dict(self, *, request: bool = False) -> dict:
        data = asdict(self)
        if not request:
            data.pop("request")
        data["ok"] = self.ok
        return data


_RECORD_KEYS = frozenset(f.name for f in fields(CallRecord))


class _NoResponse(Response):
    """Sends nothing: the connection has already been aborted."""

    def __init__(self) -> None:
        super().__init__(status_code=200)

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        return None


class _TruncatedResponse(Response):
    """Fallback for "drop" if the transport cannot be reached: start a response, then break the connection."""

    def __init__(self) -> None:
        super().__init__(status_code=200)

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")]})
        raise ConnectionAbortedError("scripted drop")


@dataclass
class _Scope:
    """What applies to the requests containing `token`."""

    token: str
    scripts: dict[str, deque] = field(default_factory=dict)
    fns: dict[str, Callable[[dict], Any]] = field(default_factory=dict)
    delay: float = 0.0
    stream_chunk_delay: float | None = None


class ScriptScope:
    """A test's own part of a shared server: scripts, delays and records of the requests that contain
    `token` (see `ScriptedLLM.scope`). A context manager; `close()` removes the scope."""

    def __init__(self, llm: ScriptedLLM, token: str) -> None:
        self.llm = llm
        self.token = token

    def __enter__(self) -> ScriptScope:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.llm._scopes.pop(self.token, None)

    def script(self, task: str, replies: list | tuple | str | dict) -> None:
        self.llm.script(task, replies, when=self.token)

    def script_fn(self, task: str, fn: Callable[[dict], Any] | None) -> None:
        self.llm.script_fn(task, fn, when=self.token)

    def pending(self, task: str) -> int:
        return self.llm.pending(task, when=self.token)

    def set_delay(self, seconds: float) -> None:
        """Wait this long before answering each of this scope's chat requests (on top of any other delay)."""
        self.llm._scope_state(self.token).delay = max(0.0, float(seconds))

    def set_stream_chunk_delay(self, seconds: float | None) -> None:
        """Pause between the chunks of this scope's streamed replies (None: the server's setting)."""
        self.llm._scope_state(self.token).stream_chunk_delay = None if seconds is None else max(0.0, float(seconds))

    def calls(self, task: str | None = None, *, step: str | None = None) -> list[CallRecord]:
        return self.llm.calls_for(task, step=step, containing=self.token)

    def count(self, task: str | None = None, ok_only: bool = False) -> int:
        return self.llm.count(task, ok_only, containing=self.token)

    async def wait_for_calls(self, n: int = 1, task: str | None = None, *, finished: bool = False,
                             timeout: float = 10.0) -> list[CallRecord]:
        return await self.llm.wait_for_calls(n, task, finished=finished, timeout=timeout, containing=self.token)


class _InProcessServer(uvicorn.Server):
    """Leaves the process's signal handlers alone (several servers may live in one test process;
    process mode installs its own)."""

    @contextlib.contextmanager
    def capture_signals(self):  # noqa: ANN201
        yield


# --------------------------------------------------------------------------------------------------
# The server


class ScriptedLLM:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, delay: float = 0.0,
                 stream_chunk_delay: float = 0.0, spread_stream: bool = False, retry_after: str | float = "1",
                 hang_seconds: float = 3600.0, log_level: str = "warning") -> None:
        self.host = host
        self._requested_port = port
        self._port: int | None = None
        self._log_level = log_level
        self._initial = dict(delay=delay, stream_chunk_delay=stream_chunk_delay, spread_stream=spread_stream,
                             retry_after=retry_after, hang_seconds=hang_seconds)
        self.calls: list[CallRecord] = []
        self._ids = 0
        self._stopping = asyncio.Event()
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None
        self._apply_defaults()
        self._app = Starlette(routes=[
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/embeddings", self._embeddings, methods=["POST"]),
            Route("/embeddings", self._embeddings, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/models", self._models, methods=["GET"]),
            Route("/_control", self._control, methods=["POST"]),
            Route("/_stats", self._stats, methods=["GET"]),
        ])

    def _apply_defaults(self) -> None:
        self.delay = float(self._initial["delay"])
        self.spread_stream = bool(self._initial["spread_stream"])
        self.stream_chunk_delay = float(self._initial["stream_chunk_delay"])
        self.retry_after = str(self._initial["retry_after"])
        self.hang_seconds = float(self._initial["hang_seconds"])
        self._scripts: dict[str, deque] = {}
        self._script_fns: dict[str, Callable[[dict], Any]] = {}
        self._scopes: dict[str, _Scope] = {}
        self._fault_rate = 0.0
        self._fault_kinds: tuple[str, ...] = FAULT_KINDS
        self._fault_tasks: frozenset[str] | None = None
        self._fault_seed: int | None = None
        self._rng = random.Random()

    # ---- lifecycle ------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the scripted LLM server is not started")
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What to give `AsyncOpenAI(base_url=...)`."""
        return f"{self.url}/v1"

    @property
    def app(self):  # noqa: ANN201
        """The ASGI application (the Starlette app behind a thin wrapper that remembers each connection)."""
        return self._asgi

    async def start(self) -> None:
        """Serve on host:port (port 0 = a free one) as a task of the running loop; returns once listening."""
        if self._task is not None:
            raise RuntimeError("already started")
        self._stopping = asyncio.Event()
        # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets whose proto says TCP,
        # and without it every response (headers and body are separate writes) waits ~40 ms for delayed ACKs.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self._requested_port))
        self._port = sock.getsockname()[1]
        config = uvicorn.Config(self._asgi, http="h11", interface="asgi3", lifespan="off", log_level=self._log_level,
                                access_log=False, proxy_headers=False, server_header=False, date_header=False,
                                timeout_graceful_shutdown=2, backlog=4096, timeout_keep_alive=30)
        self._server = _InProcessServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name=f"scripted-llm:{self._port}")
        deadline = time.monotonic() + 15
        try:
            while not self._server.started:
                if self._task.done():
                    self._task.result()  # raises what went wrong
                    raise RuntimeError("the scripted LLM server exited during startup")
                if time.monotonic() > deadline:
                    raise RuntimeError("the scripted LLM server did not start within 15 s")
                await asyncio.sleep(0.01)
        except BaseException:
            self._server.should_exit = True
            self._task.cancel()
            self._task = self._server = None
            sock.close()
            raise
        # uvicorn owns the listening socket now and closes it at shutdown.

    async def stop(self) -> None:
        """Stop serving; hung and delayed requests are released (their connections are dropped)."""
        if self._task is None:
            return
        self._stopping.set()
        assert self._server is not None
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout=10)
        except asyncio.TimeoutError:
            self._server.force_exit = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        finally:
            self._task = None
            self._server = None

    async def __aenter__(self) -> ScriptedLLM:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def serve_forever(self) -> None:
        """Process mode: serve until SIGINT/SIGTERM, then stop cleanly (exit status 0)."""
        await self.start()
        loop = asyncio.get_running_loop()
        quit_ = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, quit_.set)
        print(f"scripted LLM listening on {self.base_url}", flush=True)
        assert self._task is not None
        task = self._task
        waiter = asyncio.ensure_future(quit_.wait())
        await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        await self.stop()

    # ---- scripting and knobs -------------------------------------------------------------------

    def script(self, task: str, replies: list | tuple | str | dict, *, when: str | None = None) -> None:
        """Queue replies for `task` ("*" = any chat task), consumed in order before the default script.
        Each item: a content string; a fault name ("429", "503", "drop", "hang", "malformed", "cut" (a stream
        ended early, see SCRIPTED_FAULTS), or any 4xx/5xx code); or a dict `{"content": ...}`, `{"tool_calls": [{"name": ..., "arguments": {...}}]}`,
        `{"fault": ...}`, optionally with `"delay": seconds`. Calling again appends.
        With `when`, only requests whose messages contain that token consume them (see `scope`); such
        requests take their scope's replies before the unscoped ones."""
        if isinstance(replies, (str, dict)):
            replies = [replies]
        items = [Reply.of(r) for r in replies]
        scripts = self._scripts if when is None else self._scope_state(when).scripts
        scripts.setdefault(task, deque()).extend(items)

    def script_fn(self, task: str, fn: Callable[[dict], Any] | None, *, when: str | None = None) -> None:
        """Dynamic replies for `task` ("*" = any chat task): `fn(request_json)` returns a reply item (see
        `script`), or None for the default. May be a coroutine function. `fn=None` removes it. With
        `when`, only for requests whose messages contain that token."""
        fns = self._script_fns if when is None else self._scope_state(when).fns
        if fn is None:
            fns.pop(task, None)
        else:
            fns[task] = fn

    def clear_script(self, task: str | None = None, *, when: str | None = None) -> None:
        """Forget queued replies and script functions: of `task` (or all), unscoped or of scope `when`.
        `clear_script()` with neither forgets every script, scoped ones included."""
        if when is not None:
            state = self._scopes.get(when)
            if state is not None:
                for table in (state.scripts, state.fns):
                    table.clear() if task is None else table.pop(task, None)
            return
        if task is None:
            self._scripts.clear()
            self._script_fns.clear()
            self._scopes.clear()
        else:
            self._scripts.pop(task, None)
            self._script_fns.pop(task, None)

    def pending(self, task: str, *, when: str | None = None) -> int:
        """How many scripted replies for `task` are still queued (unscoped, or of scope `when`)."""
        if when is not None:
            state = self._scopes.get(when)
            return len(state.scripts.get(task, ())) if state is not None else 0
        return len(self._scripts.get(task, ()))

    def scope(self, token: str | None = None, *, delay: float = 0.0,
              stream_chunk_delay: float | None = None) -> ScriptScope:
        """A scope for the requests whose messages contain `token` (default: a fresh unique one, read it
        from `.token` and put it in your question). Its scripts come before the unscoped ones, its delay
        adds to the server's, and `.calls()` / `.count()` see only its requests. Leaving the `with`
        block (or `.close()`) removes it; requests with the token are then ordinary again."""
        token = token or f"tok{uuid.uuid4().hex[:10]}"
        state = self._scope_state(token)
        state.delay = max(0.0, float(delay))
        state.stream_chunk_delay = stream_chunk_delay
        return ScriptScope(self, token)

    def _scope_state(self, token: str) -> _Scope:
        if not token:
            raise ValueError("a scope needs a non-empty token")
        return self._scopes.setdefault(token, _Scope(token))

    def _scopes_of(self, text: str) -> list[_Scope]:
        return [s for s in self._scopes.values() if s.token in text]

    def set_faults(self, rate: float = 0.0, kinds: list[str] | tuple[str, ...] | None = None,
                   seed: int | None = None, *, tasks: list[str] | None = None,
                   retry_after: str | float | None = None) -> None:
        """Random faults: each eligible request gets a fault with probability `rate`, the kind chosen
        uniformly from `kinds`. One draw per eligible request in arrival order, so a `seed` makes the
        sequence reproducible. `tasks` limits which tasks are eligible (default: every chat task; add
        "embeddings" to include embedding requests). `rate=0` turns random faults off."""
        kinds = tuple(kinds) if kinds else FAULT_KINDS
        for kind in kinds:
            if not is_fault(kind):
                raise ValueError(f"unknown fault {kind!r}")
        if not 0.0 <= rate <= 1.0:
            raise ValueError("rate must be within [0, 1]")
        self._fault_rate = float(rate)
        self._fault_kinds = kinds
        self._fault_seed = seed
        self._fault_tasks = frozenset(tasks) if tasks is not None else None
        self._rng = random.Random(seed)
        if retry_after is not None:
            self.set_retry_after(retry_after)

    def set_delay(self, seconds: float, *, spread_stream: bool | None = None) -> None:
        """Wait this long before answering every chat request. With `spread_stream=True` a streamed reply
        starts at once and the delay is spread between its chunks instead."""
        self.delay = max(0.0, float(seconds))
        if spread_stream is not None:
            self.spread_stream = bool(spread_stream)

    def set_stream_chunk_delay(self, seconds: float) -> None:
        """Pause between the chunks of every streamed reply."""
        self.stream_chunk_delay = max(0.0, float(seconds))

    def set_retry_after(self, value: str | float | None) -> None:
        """The Retry-After header of 429 answers (None: no header)."""
        self.retry_after = None if value is None else (value if isinstance(value, str) else f"{value:g}")

    def configure(self, *, reset: bool = False, clear_calls: bool = False, delay: float | None = None,
                  spread_stream: bool | None = None, stream_chunk_delay: float | None = None,
                  faults: dict | None = None, retry_after: str | float | None = None,
                  hang_seconds: float | None = None, script: dict[str, list] | None = None) -> dict:
        """Every knob at once; what `POST /_control` takes as JSON. Returns the resulting settings."""
        if reset:
            self.reset()
        if clear_calls:
            self.clear_calls()
        if delay is not None or spread_stream is not None:
            self.set_delay(self.delay if delay is None else delay, spread_stream=spread_stream)
        if stream_chunk_delay is not None:
            self.set_stream_chunk_delay(stream_chunk_delay)
        if faults is not None:
            self.set_faults(**faults)
        if retry_after is not None:
            self.set_retry_after(retry_after)
        if hang_seconds is not None:
            self.hang_seconds = float(hang_seconds)
        for task, replies in (script or {}).items():
            self.script(task, replies)
        return self.settings()

    def settings(self) -> dict:
        return {"delay": self.delay, "spread_stream": self.spread_stream,
                "stream_chunk_delay": self.stream_chunk_delay, "retry_after": self.retry_after,
                "hang_seconds": self.hang_seconds,
                "faults": {"rate": self._fault_rate, "kinds": list(self._fault_kinds), "seed": self._fault_seed,
                           "tasks": sorted(self._fault_tasks) if self._fault_tasks is not None else None},
                "scripted": {task: len(q) for task, q in self._scripts.items() if q},
                "script_fns": sorted(self._script_fns),
                "scopes": {s.token: {"scripted": {task: len(q) for task, q in s.scripts.items() if q},
                                     "script_fns": sorted(s.fns), "delay": s.delay,
                                     "stream_chunk_delay": s.stream_chunk_delay} for s in self._scopes.values()}}

    # ---- accounting ----------------------------------------------------------------------------

    def count(self, task: str | None = None, ok_only: bool = False, *, containing: str | None = None) -> int:
        """Requests received (chat and embeddings; `task="embeddings"` for the latter), optionally only
        those answered successfully, or only those whose messages contain the text `containing`."""
        return sum(1 for c in self.calls_for(task, containing=containing) if not ok_only or c.ok)

    def calls_for(self, task: str | None = None, *, step: str | None = None,
                  containing: str | None = None) -> list[CallRecord]:
        return [c for c in self.calls if (task is None or c.task == task) and (step is None or c.step == step)
                and (containing is None or containing in c.text)]

    @property
    def in_flight(self) -> int:
        return sum(1 for c in self.calls if c.finished_at is None)

    def max_concurrency(self, task: str | None = None) -> int:
        """The largest number of requests (of `task`) that were being served at the same moment."""
        events: list[tuple[float, int]] = []
        for c in self.calls_for(task):
            events.append((c.started_at, 1))
            events.append((c.finished_at if c.finished_at is not None else math.inf, -1))
        events.sort(key=lambda e: (e[0], e[1]))  # ends before starts at the same instant
        best = cur = 0
        for _, d in events:
            cur += d
            best = max(best, cur)
        return best

    async def wait_for_calls(self, n: int = 1, task: str | None = None, *, finished: bool = False,
                             timeout: float = 10.0, containing: str | None = None) -> list[CallRecord]:
        """Wait until at least `n` requests (of `task`, whose messages contain `containing`) have arrived
        (or, with `finished`, completed)."""
        deadline = time.monotonic() + timeout
        while True:
            found = [c for c in self.calls_for(task, containing=containing)
                     if not finished or c.finished_at is not None]
            if len(found) >= n:
                return found
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(found)} of {n} {task or 'any'} calls after {timeout} s")
            await asyncio.sleep(0.01)

    def clear_calls(self) -> None:
        self.calls.clear()

    def reset(self) -> None:
        """Back to the state of a fresh server: no records, no scripts, no faults, constructor delays."""
        self.calls.clear()
        self._apply_defaults()

    def stats(self, *, include_calls: bool = True) -> dict:
        by_task: dict[str, dict[str, int]] = {}
        for c in self.calls:
            t = by_task.setdefault(c.task, {"total": 0, "ok": 0})
            t["total"] += 1
            t["ok"] += c.ok
        faults: dict[str, int] = {}
        for c in self.calls:
            if c.fault:
                faults[c.fault] = faults.get(c.fault, 0) + 1
        data = {"total": len(self.calls), "ok": self.count(ok_only=True), "in_flight": self.in_flight,
                "max_concurrency": self.max_concurrency(), "by_task": by_task, "faults": faults,
                "settings": self.settings(), "now": time.monotonic()}
        if include_calls:
            data["calls"] = [c.as_dict() for c in self.calls]
        return data

    # ---- request handling ----------------------------------------------------------------------

    async def _asgi(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] == "http":
            # uvicorn's `send` is a bound method of the request cycle, which holds the connection's transport.
            scope[_TRANSPORT_KEY] = getattr(getattr(send, "__self__", None), "transport", None)
        await self._app(scope, receive, send)

    def _record(self, endpoint: str, task: str, stream: bool, request: Request, body: dict) -> CallRecord:
        self._ids += 1
        headers = {k.lower(): v for k, v in request.headers.items()}
        user = last_user_message(body.get("messages") or []) if endpoint == "chat" else ""
        question = parse_prompt(user)[1] if user else None
        if endpoint == "chat":
            text = "\n".join(message_text(m.get("content")) for m in body.get("messages") or []
                             if isinstance(m, dict))
        else:
            raw = body.get("input")
            text = raw if isinstance(raw, str) else "\n".join(i for i in raw or [] if isinstance(i, str))
        scopes = self._scopes_of(text)
        rec = CallRecord(id=self._ids, endpoint=endpoint, task=task, stream=stream, model=body.get("model"),
                         started_at=time.monotonic(), user_message=user,
                         question=question if question is not None else user.strip(),
                         scope=scopes[0].token if scopes else None, text=text,
                         step=headers.get("x-ragline-step"),
                         idempotency_key=headers.get("idempotency-key") or headers.get("x-idempotency-key"),
                         headers=headers, request=body)
        self.calls.append(rec)
        return rec

    async def _choose(self, task: str, body: dict, chat: bool, scopes: list[_Scope] = ()) -> tuple[Reply | None, bool]:
        """(reply, scripted). Scripted replies of the request's scopes first, then their script functions,
        then unscoped scripted replies and script functions, then random faults."""
        random_fault = None
        eligible = (self._fault_tasks is None and chat) or (self._fault_tasks is not None and task in self._fault_tasks)
        if self._fault_rate > 0 and eligible:
            u = self._rng.random()  # exactly one draw per eligible request keeps seeded runs reproducible
            if u < self._fault_rate:
                random_fault = self._fault_kinds[min(int(u / self._fault_rate * len(self._fault_kinds)),
                                                     len(self._fault_kinds) - 1)]
        keys = (task, ANY_TASK) if chat else (task,)
        for scripts, fns in [*((s.scripts, s.fns) for s in scopes), (self._scripts, self._script_fns)]:
            reply = await self._scripted(keys, scripts, fns, body)
            if reply is not None:
                return reply, True
        if random_fault is not None:
            return Reply(fault=random_fault), False
        return None, False

    @staticmethod
    async def _scripted(keys: tuple[str, ...], scripts: dict[str, deque], fns: dict[str, Callable],
                        body: dict) -> Reply | None:
        for key in keys:
            queue = scripts.get(key)
            if queue:
                return queue.popleft()
        for key in keys:
            fn = fns.get(key)
            if fn is not None:
                item = fn(body)
                if inspect.isawaitable(item):
                    item = await item
                reply = Reply.of(item)
                if reply is not None:
                    return reply
        return None

    async def _wait(self, seconds: float, receive=None) -> str:  # noqa: ANN001
        """Sleep, cut short by server stop or (if `receive` is given) by the client going away.
        Returns "elapsed", "stopped" or "disconnected"."""
        if seconds <= 0:
            return "elapsed"
        if self._stopping.is_set():
            return "stopped"
        if receive is None and seconds <= 1.0:
            await asyncio.sleep(seconds)  # short pauses (stream chunks): cheap, and stop can wait that long
            return "stopped" if self._stopping.is_set() else "elapsed"
        waiters = {asyncio.ensure_future(asyncio.sleep(seconds)): "elapsed",
                   asyncio.ensure_future(self._stopping.wait()): "stopped"}
        if receive is not None:
            waiters[asyncio.ensure_future(_until_disconnect(receive))] = "disconnected"
        try:
            done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
        outcomes = {waiters[d] for d in done}
        for outcome in ("stopped", "disconnected", "elapsed"):
            if outcome in outcomes:
                return outcome
        return "elapsed"

    async def _drop(self, request: Request) -> Response:
        transport = request.scope.get(_TRANSPORT_KEY)
        if transport is None:
            return _TruncatedResponse()
        transport.abort()
        # Let uvicorn notice the closed connection before the handler returns.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(_until_disconnect(request.receive), timeout=1.0)
        return _NoResponse()

    async def _fault(self, fault: str, rec: CallRecord, request: Request, stream: bool) -> Response:
        rec.fault = fault
        if fault == "drop":
            return await self._drop(request)
        if fault == "hang":
            outcome = await self._wait(self.hang_seconds, request.receive)
            if outcome == "disconnected":
                rec.client_disconnected = True
                return _NoResponse()
            return await self._drop(request)  # server stopping, or hang_seconds elapsed
        if fault == "cut":
            rec.status = 200
            return StreamingResponse(_cut_stream(rec), media_type="text/event-stream")
        if fault == "malformed":
            rec.status = 200
            if stream:
                return StreamingResponse(_malformed_stream(rec), media_type="text/event-stream")
            return Response(b'{"id": "chatcmpl-malformed", "object": "chat.completion", "choices": [{"index": 0, '
                            b'"message": {"role": "assistant", "content": "trunc', status_code=200,
                            media_type="application/json")
        status = int(fault)
        rec.status = status
        headers = {"retry-after": self.retry_after} if status == 429 and self.retry_after is not None else {}
        fallback = "server_error" if status >= 500 else "invalid_request_error"
        kind = {429: "rate_limit_exceeded", 503: "server_overloaded"}.get(status, fallback)
        message = {429: "Rate limit reached (scripted fault).", 503: "The server is overloaded (scripted fault)."}.get(
            status, f"Scripted fault {status}.")
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": kind}},
                            status_code=status, headers=headers)

    async def _chat(self, request: Request) -> Response:
        body = await _json_body(request)
        if body is None:
            return _error(400, "the body must be a JSON object")
        messages = body.get("messages") or []
        task = detect_task(messages, request.headers.get("x-ragline-step"))
        stream = bool(body.get("stream"))
        rec = self._record("chat", task, stream, request, body)
        scopes = self._scopes_of(rec.text)
        scope_delay = next((s.delay for s in scopes if s.delay), 0.0)
        chunk_delay = next((s.stream_chunk_delay for s in scopes if s.stream_chunk_delay is not None),
                           self.stream_chunk_delay)
        streaming = False
        try:
            reply, scripted = await self._choose(task, body, chat=True, scopes=scopes)
            rec.scripted = scripted
            if reply is None or (reply.fault is None and reply.content is None and not reply.tool_calls):
                extra = reply.delay if reply is not None else 0.0
                reply = Reply.of(default_reply(task, body))
                assert reply is not None
                reply.delay += extra
            spread = stream and self.spread_stream
            wait = reply.delay + scope_delay + (0.0 if spread else self.delay)
            if wait > 0:
                outcome = await self._wait(wait, request.receive)
                if outcome == "disconnected":
                    rec.client_disconnected = True
                    return _NoResponse()
                # on "stopped", answer at once
            if reply.fault is not None:
                response = await self._fault(reply.fault, rec, request, stream)
                streaming = isinstance(response, StreamingResponse)
                return response
            rec.reply = reply.text()
            rec.status = 200
            completion_id = f"chatcmpl-scripted-{rec.id}"
            model = body.get("model") or MODEL_ID
            usage = _usage(messages, reply)
            headers = {"x-request-id": f"req_scripted_{rec.id}"}
            if stream:
                streaming = True
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                gen = self._stream(rec, completion_id, model, reply, usage, include_usage,
                                   self.delay if spread else 0.0, chunk_delay)
                return StreamingResponse(gen, media_type="text/event-stream", headers=headers)
            message: dict[str, Any] = {"role": "assistant", "content": reply.content if not reply.tool_calls
                                       else (reply.content or None), "refusal": None}
            finish = "stop"
            if reply.tool_calls:
                message["tool_calls"] = _tool_calls(reply.tool_calls, rec.id)
                finish = "tool_calls"
            return JSONResponse({
                "id": completion_id, "object": "chat.completion", "created": _CREATED, "model": model,
                "system_fingerprint": "fp_scripted",
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": usage}, headers=headers)
        finally:
            if not streaming:
                rec.finished_at = time.monotonic()

    async def _stream(self, rec: CallRecord, completion_id: str, model: str, reply: Reply, usage: dict,
                      include_usage: bool, spread_delay: float, chunk_delay: float | None = None):
        completed = False

        def chunk(delta: dict, finish: str | None = None, **extra: Any) -> bytes:
            data = {"id": completion_id, "object": "chat.completion.chunk", "created": _CREATED, "model": model,
                    "system_fingerprint": "fp_scripted",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
            if include_usage:
                data["usage"] = None
            data.update(extra)
            return _sse(data)

        try:
            if reply.tool_calls:
                deltas = [{"role": "assistant", "content": None}]
                for i, call in enumerate(_tool_calls(reply.tool_calls, rec.id)):
                    deltas.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                                   "function": {"name": call["function"]["name"], "arguments": ""}}]})
                    deltas.append({"tool_calls": [{"index": i,
                                                   "function": {"arguments": call["function"]["arguments"]}}]})
                finish = "tool_calls"
            else:
                deltas = [{"role": "assistant", "content": ""}] + [{"content": p} for p in split_deltas(
                    reply.content or "")]
                finish = "stop"
            chunk_pause = self.stream_chunk_delay if chunk_delay is None else chunk_delay
            pause = chunk_pause + (spread_delay / max(1, len(deltas) - 1))
            for i, delta in enumerate(deltas):
                if i > 0 and pause > 0:
                    await self._wait(pause)
                yield chunk(delta)
            yield chunk({}, finish)
            if include_usage:
                yield _sse({"id": completion_id, "object": "chat.completion.chunk", "created": _CREATED,
                            "model": model, "system_fingerprint": "fp_scripted", "choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"
            completed = True
        finally:
            rec.finished_at = time.monotonic()
            if not completed:
                rec.client_disconnected = True

    async def _embeddings(self, request: Request) -> Response:
        body = await _json_body(request)
        if body is None:
            return _error(400, "the body must be a JSON object")
        rec = self._record("embeddings", EMBEDDINGS_TASK, False, request, body)
        try:
            reply, scripted = await self._choose(EMBEDDINGS_TASK, body, chat=False,
                                                 scopes=self._scopes_of(rec.text))
            rec.scripted = scripted
            if reply is not None and reply.delay > 0:
                if await self._wait(reply.delay, request.receive) == "disconnected":
                    rec.client_disconnected = True
                    return _NoResponse()
            if reply is not None and reply.fault is not None:
                return await self._fault(reply.fault, rec, request, False)
            raw = body.get("input")
            inputs = [raw] if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)) \
                else list(raw or [])
            if not inputs:
                rec.status = 400
                return _error(400, "input must not be empty")
            dims = int(body.get("dimensions") or EMBED_DIM)
            as_base64 = body.get("encoding_format") == "base64"
            data = []
            tokens = 0
            for i, item in enumerate(inputs):
                text = item if isinstance(item, str) else json.dumps(item)
                tokens += max(1, len(text) // 4)
                vector = embed(text, dims)
                value: Any = base64.b64encode(struct.pack(f"<{dims}f", *vector)).decode() if as_base64 else vector
                data.append({"object": "embedding", "index": i, "embedding": value})
            rec.status = 200
            return JSONResponse({"object": "list", "data": data, "model": body.get("model") or MODEL_ID,
                                 "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
        finally:
            rec.finished_at = time.monotonic()

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": MODEL_ID, "object": "model", "created": _CREATED, "owned_by": "ragline-tests"}]})

    async def _control(self, request: Request) -> Response:
        try:
            knobs = await request.json()
            return JSONResponse(self.configure(**(knobs or {})))
        except (TypeError, ValueError) as exc:
            return _error(400, str(exc))

    async def _stats(self, request: Request) -> Response:
        include = request.query_params.get("calls", "1") not in ("0", "false", "no")
        return JSONResponse(self.stats(include_calls=include))


# --------------------------------------------------------------------------------------------------
# Helpers

_CREATED = 1_700_000_000


async def _json_body(request: Request) -> dict | None:
    try:
        body = await request.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


async def _until_disconnect(receive) -> None:  # noqa: ANN001
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return


def _sse(data: dict) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


async def _cut_stream(rec: CallRecord):
    try:
        yield _sse({"id": "chatcmpl-cut", "object": "chat.completion.chunk", "created": _CREATED, "model": MODEL_ID,
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Acc"}, "finish_reason": None}]})
        yield b"data: [DONE]\n\n"
    finally:
        rec.finished_at = time.monotonic()


async def _malformed_stream(rec: CallRecord):
    try:
        yield _sse({"id": "chatcmpl-malformed", "object": "chat.completion.chunk", "created": _CREATED,
                    "model": MODEL_ID, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Acc"},
                                                    "finish_reason": None}]})
        yield b'data: {"id": "chatcmpl-malformed", "object": "chat.completion.chunk", "choices": [{"delta": {"con\n\n'
        yield b"data: [DONE]\n\n"
    finally:
        rec.finished_at = time.monotonic()


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                   "code": None}}, status_code=status)


def _tool_calls(calls: list[dict], rec_id: int) -> list[dict]:
    out = []
    for i, call in enumerate(calls):
        if "function" in call:  # already in OpenAI shape
            fn = call["function"]
            name, args = fn.get("name"), fn.get("arguments", {})
        else:
            name, args = call.get("name"), call.get("arguments", {})
        out.append({"id": call.get("id") or f"call_scripted_{rec_id}_{i}", "type": "function",
                    "function": {"name": name,
                                 "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}})
    return out


def _usage(messages: list[dict], reply: Reply) -> dict:
    prompt = "\n".join(message_text(m.get("content")) for m in messages if isinstance(m, dict))
    prompt_tokens = max(1, len(prompt) // 4)
    if reply.tool_calls:
        completion_tokens = max(1, len(reply.text()) // 4)
    else:
        completion_tokens = max(1, len((reply.content or "").split()))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def split_deltas(text: str) -> list[str]:
    """Word by word (each piece keeps its trailing space); text with fewer than three words is cut into
    smaller pieces so that any non-trivial answer streams as at least three deltas."""
    if not text:
        return []
    pieces = re.findall(r"\S+\s*|\s+", text)
    if len(pieces) >= 3 or len(text) < 3:
        return pieces
    n = min(len(text), 4)
    size = math.ceil(len(text) / n)
    return [text[i:i + size] for i in range(0, len(text), size)]


def embed(text: str, dims: int = EMBED_DIM) -> list[float]:
    """A deterministic unit vector from a hash of `text`: equal strings give equal vectors."""
    raw = hashlib.shake_256(text.encode("utf-8")).digest(2 * dims)
    values = [(v / 32767.5) - 1.0 for v in struct.unpack(f"<{dims}H", raw)]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]


# --------------------------------------------------------------------------------------------------
# Process mode


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m devtools.scripted_llm",
                                     description="Scripted OpenAI-compatible server for tests and benchmarks.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8999, help="0 picks a free port (printed at start)")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before answering each chat request")
    parser.add_argument("--spread-stream", action="store_true", help="spread --delay between stream chunks")
    parser.add_argument("--chunk-delay", type=float, default=0.0, help="seconds between stream chunks")
    parser.add_argument("--fault-rate", type=float, default=0.0)
    parser.add_argument("--fault-kinds", default=",".join(FAULT_KINDS), help="comma-separated")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--retry-after", default="1")
    parser.add_argument("--hang-seconds", type=float, default=3600.0)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    llm = ScriptedLLM(args.host, args.port, delay=args.delay, stream_chunk_delay=args.chunk_delay,
                      spread_stream=args.spread_stream, retry_after=args.retry_after,
                      hang_seconds=args.hang_seconds, log_level=args.log_level)
    if args.fault_rate:
        llm.set_faults(args.fault_rate, [k.strip() for k in args.fault_kinds.split(",") if k.strip()], args.seed)
    asyncio.run(llm.serve_forever())


if __name__ == "__main__":
    sys.exit(main())
