"""Chat: a question in a session, the turn that answers it, and the chain's step inputs and outputs."""

from __future__ import annotations

import hashlib
import re
from datetime import datetime

from pydantic import BaseModel, Field

from models.inputs import STRICT_INPUT, Int
from models.jobs import COLLECTION_PATTERN, StepResult, StreamedStepResult
from models.review import ReviewRecord
from models.tenancy import DEFAULT_TENANT, workflow_id


MESSAGE_MAX_CHARS = 8000


class ChatQuestion(BaseModel):
    """What a person asks. `POST /v1/chats` takes this (plus a session id); the turn carries it as is."""
    model_config = STRICT_INPUT
    message: str = Field(min_length=1, max_length=MESSAGE_MAX_CHARS)
    collection: str = Field("default", pattern=COLLECTION_PATTERN)
    top_k: Int = Field(5, ge=1, le=20)
    require_review: bool = Field(False, description="Hold the answer until a reviewer approves it")


class HistoryItem(BaseModel):
    question: str
    answer: str


class TurnContext(BaseModel):
    """Sent by the session when it is this turn's go: the recent turns to answer in context."""
    history: list[HistoryItem] = []
    # The job of the turn before, when its summary and entities step aside for this turn's answer (a small
    # model endpoint): told once that answer is out.
    before: str | None = None


class TurnAnswered(BaseModel):
    """Sent by a turn's job to its session once its answer is final, when a later turn of the session waits."""
    job_id: str
    answer: str
    # Its summary and entities step aside for the next turn's answer (a small model endpoint): the next turn
    # tells it once that answer is out (`TurnContext.before`).
    steps_aside: bool = False


class TurnInput(BaseModel):
    """A turn as the API hands it to the session (signal `submit`) and as its job runs it."""
    tenant: str = DEFAULT_TENANT
    job_id: str
    session_id: str
    question: ChatQuestion
    # Server policy at acceptance: hold answers without a supporting citation; how long a review waits.
    review_unsupported: bool = False
    review_timeout_seconds: float = 86400
    # Numbered by the session when it takes the turn, in acceptance order (0 until then).
    turn: int = 0
    # A fallback model is configured: generate_answer_fallback answers when generate_answer keeps failing.
    fallback: bool = False
    # Set by the session when nothing runs before this turn: its go comes with its start, no signal.
    context: TurnContext | None = None
    # The W3C traceparent of the request that made the turn: the session starts the turn's job in that
    # trace (the session itself lives in its first request's trace).
    traceparent: str | None = None
    # A keyed request's digest: the session puts it in the job's memo (REQUEST_MEMO), so that the same
    # Idempotency-Key sent with another question is refused, not answered with this turn's job.
    request: str | None = None
    # When the API accepted it: a turn still waiting for its session to start its job shows this.
    accepted_at: datetime | None = None
    # The tenant's fairness weight when the API accepted it (`[tenants.<name>] fairness_weight`): the turn's
    # job runs with it, whatever weight the session started with.
    fairness_weight: float | None = None
    # RAGLINE_SESSION_MAX_QUEUED_TURNS when the API accepted it: the session takes the turn only while it holds
    # fewer turns not yet answered (None: no bound, turns accepted before it had one).
    session_max_queued: int | None = None
    # Set by the session when it does not take the turn (SESSION_BUSY): its job starts only to fail saying so,
    # with error type `refused_type` (None: SessionBusy).
    refused: str | None = None
    refused_type: str | None = None


# The key of a failed turn's failure details that holds the answer it had shown (workflows/chat.py).
FINAL_ANSWER_DETAIL = "final_answer"


class SessionRun(BaseModel):
    """The session run that started a chat turn's job (its parent), and the first run of its chain once
    a look at the session has found it."""
    workflow_id: str
    run_id: str
    first_run_id: str | None = None


class SessionRunning(BaseModel):
    running: bool
    first_run_id: str | None = None  # of the chain of the run that started the turn, when known


def session_busy(queued: int) -> str:
    return (f"its session already holds {queued} turns not yet answered (RAGLINE_SESSION_MAX_QUEUED_TURNS): this "
            "message was not queued and no model was called for it; send it again once earlier turns have answers "
            "(under a new Idempotency-Key, if it had one: this one now names this failed job)")


# A keyed turn sent again after the job its key names is gone (Temporal's retention): the session knows the id.
KEY_EXPIRED = ("this request ran before under its Idempotency-Key, and that turn's job is past Temporal's retention "
               "(its answer is gone): nothing ran for it now; send it again under a new Idempotency-Key")
KEY_EXPIRED_TYPE = "IdempotencyKeyExpired"


SESSION_ENDED = ("its session's workflow ended (terminated by hand?) before it gave this turn its go: the turn "
                 "never ran (no model was called for it); send the question again")


class TurnOutcome(BaseModel):
    """What the session keeps of a finished turn: its answer, or None when the turn failed or has none."""
    answer: str | None = None


class SessionState(BaseModel):
    """Everything a session carries through continue-as-new."""
    tenant: str = DEFAULT_TENANT
    session_id: str
    next_turn: int = 1
    # Job ids of recent turns, oldest first (bounded): a resent request is not queued twice.
    seen: list[str] = []
    # Accepted turns whose go has not come yet; their jobs exist already (started at acceptance).
    pending: list[TurnInput] = []
    history: list[HistoryItem] = []
    # Continue-as-new after this many turns even if the server does not ask (tests make it small).
    turns_per_run: int = 100
    # ... and after this many messages, even while a turn runs: messages keep coming while a reviewer holds
    # the turn at the head, each a signal and a child's start in this run's history.
    submits_per_run: int = 1000
    # Set by the API when it starts the session again after a run of it ended idle (that run's id): the new
    # run takes up what that one left (turn numbers, seen, history) before it numbers any turn.
    resumed_from: str | None = None
    # The final answer the head turn told (by job id) before the run continued as new: the turn tells it once.
    answered: dict[str, str] = {}
    # The job of the turn just run, when its side steps step aside for the next turn's answer and the run continued
    # as new before that turn's go: the next turn is given it to tell (`TurnContext.before`).
    next_tells: str | None = None


class SessionLeft(BaseModel):
    """What a chat session's run that ended idle left (its result); None when that run ended otherwise
    (terminated by hand, failed) or is gone (the retention): the session then starts anew."""
    state: SessionState | None = None


class Citation(BaseModel):
    document_id: str
    filename: str
    page: int
    chunk_id: str
    score: float
    # The calibrated relevance of the passage to the question (0..1) and the span of it the answer uses.
    relevance: float = 0.0
    quote: str = ""


class Entity(BaseModel):
    text: str
    type: str


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def __add__(self, other: "Usage") -> "Usage":
        return Usage(prompt_tokens=self.prompt_tokens + other.prompt_tokens,
                     completion_tokens=self.completion_tokens + other.completion_tokens)


class TurnResult(BaseModel):
    session_id: str
    turn: int
    question: str
    answer: str
    citations: list[Citation]
    summary: str
    entities: list[Entity]
    model: str
    usage: Usage
    warnings: list[str] = []
    review: ReviewRecord | None = None
    # False when no passage was relevant enough (the answer says the documents do not cover it, and no
    # model was called) or when the model's answer cites no passage and none supports it; for a
    # reviewer's answer, when its [n] markers name none of the turn's passages.
    supported: bool = True
    # A reviewer replaced the model's answer with this text (`review` names them; the model's text stays
    # in `review.proposed_action`, for reviewers): `citations` and `supported` are those of this text.
    written_by_reviewer: bool = False
    # Served from the answer cache (same question, same collection version): no model call.
    cached: bool = False
    # Set when the configured model kept failing and the fallback model answered.
    fallback_model: str | None = None
    # False when `answer` is not an answer to the question but says why there is none (the documents do not
    # cover it, the model gave no usable reply): it is kept out of the session's history, where a small
    # model would only repeat it.
    answered: bool = True


SESSION_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
_TURN_JOB_ID = re.compile(r"^(?:[a-z0-9][a-z0-9-]{0,31}\.)?chat-(?P<session>[A-Za-z0-9_-]{1,64})\.(?P<digest>[0-9a-f]{20})$")


def session_workflow_id(tenant: str, session_id: str) -> str:
    return workflow_id(tenant, f"session-{session_id}")


def keyed_session_id(request_key: str) -> str:
    """The session a keyed request without a session id starts: the same Idempotency-Key names the same
    new session, so a resent first message finds its job instead of starting a second conversation."""
    return "k" + hashlib.sha256(f"session\n{request_key}".encode()).hexdigest()[:31]


def turn_job_id(session_id: str, request_key: str) -> str:
    """A turn's job id, known without asking any workflow: the same session and Idempotency-Key give the
    same job (a resent request is not run twice), and a fresh key a fresh job for the life of the id."""
    digest = hashlib.sha256(f"{session_id}\n{request_key}".encode()).hexdigest()[:20]
    return f"chat-{session_id}.{digest}"


def session_of_turn(job_id: str) -> str | None:
    """The session id inside a turn's job id (with or without its tenant prefix), or None when
    `job_id` is not a turn's."""
    match = _TURN_JOB_ID.match(job_id)
    return match["session"] if match else None


# -- the chain's steps -----------------------------------------------------------------------------

class RetrieveInput(BaseModel):
    tenant: str = DEFAULT_TENANT
    question: str
    collection: str
    top_k: int
    # Look the question up in the answer cache first (a turn without conversation history).
    use_cache: bool = False
    # The session's question before this one: a follow-up is also searched together with it.
    follows: str | None = None


class RetrieveOutput(StepResult):
    # Passages (with their text) live in the blob store; only the reference travels.
    context_ref: str
    passages: int
    citations: list[Citation]
    # False when the passages exceed the model's context budget: the answer then works from a summary.
    fits: bool = True
    # False when no passage reaches the relevance threshold: `refusal` is then the whole answer.
    supported: bool = True
    refusal: str | None = None
    # What the turn should tell besides its answer (the collection has no documents: a misspelt name?).
    warnings: list[str] = []
    # The answer cache: its key for this question and collection version (None: not to be kept), and the
    # answer when it hit.
    cache_key: str | None = None
    cached: TurnResult | None = None


class CacheInput(BaseModel):
    key: str
    result: TurnResult


class CacheOutput(StepResult):
    stored: bool


class ContextInput(BaseModel):
    question: str
    context_ref: str
    # The summary the answer waits for (the passages overflow the model's context): no answer call comes
    # before it to open alike with, so it has a system prompt of its own (ragline/prompts.toml).
    before_answer: bool = False


class SummaryOutput(StepResult):
    summary: str
    usage: Usage = Usage()


class EntitiesOutput(StepResult):
    entities: list[Entity]
    warnings: list[str] = []
    usage: Usage = Usage()


class GenerateInput(BaseModel):
    question: str
    context_ref: str
    # Only when the passages did not fit the context budget: the answer works from this instead.
    summary: str | None = None
    history: list[HistoryItem] = []
    # Whether the answer streams to the job's events as it comes: not when a reviewer may hold it.
    stream: bool = True
    # Attempts at the answer made before this activity (the configured model's before its fallback, the rounds
    # before an operator's retry): its deltas' `attempt` numbers on from them, so each generation has its own.
    attempts_before: int = 0


# A chat turn's side steps (summary, entities) make up to this many model calls at once: on a worker with no
# more model slots, a later turn's answer would wait for them, and they step aside for it (workflows/chat.py).
SIDE_STEPS = 2


class GenerateOutput(StreamedStepResult):
    answer: str
    # 1-based numbers of the passages the answer relies on, and their citations with the quoted span.
    cited: list[int]
    citations: list[Citation] = []
    # False when the answer cites no passage and no passage supports its content.
    grounded: bool = True
    # False when the model's reply had no words of its own ("[1] [2]", ""): `answer` is then the turn's
    # notice of that (prompts.no_answer) and a warning says what the model gave.
    answered: bool = True
    model: str
    usage: Usage = Usage()
    # What the turn should tell about this answer (the model looped and the answer was cut).
    warnings: list[str] = []
    # Model calls the worker makes at once (RAGLINE_LLM_CONCURRENCY): with no more than a turn's side steps,
    # a later turn's answer would wait for them (None: a worker from before this was told).
    model_slots: int | None = None


class AwaitTurnInput(BaseModel):
    workflow_id: str
