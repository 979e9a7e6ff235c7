"""Declarative timeouts and retry policies, read from `policies.toml` (or RAGLINE_POLICIES).

The worker calls `load()` once at start with the names of the activities it registers: every one of
them gets a policy (its own section, else [defaults]), and a section naming no registered activity
stops the worker, so a renamed activity cannot silently lose its policy. Workflow code never names
an activity by a string: `options(activity_name(ChatActivities.generate_answer))` is derived from
the definition.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from temporalio import activity
from temporalio.common import Priority, RetryPolicy

from models.chat import SIDE_STEPS
from ragline.errors import RaglineError
from temporal import queues

DEFAULT_FILE = Path(__file__).with_name("policies.toml")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


class PolicyError(ValueError):
    pass


def parse_duration(value: Any) -> timedelta:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if not match:
            raise ValueError(f"not a duration: {value!r} (use e.g. \"30s\", \"5m\")")
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if seconds < 0:
        raise ValueError(f"negative duration: {value!r}")
    return timedelta(seconds=seconds)


class _Partial(BaseModel):
    model_config = ConfigDict(extra="forbid")

    start_to_close: timedelta | None = None
    heartbeat: timedelta | None = None
    initial_interval: timedelta | None = None
    backoff: float | None = None
    max_interval: timedelta | None = None
    max_attempts: int | None = None
    non_retryable: list[str] | None = None
    queue: queues.QueueKind | None = None
    priority: int | None = None

    @field_validator("start_to_close", "heartbeat", "initial_interval", "max_interval", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> timedelta | None:
        return None if value is None else parse_duration(value)

    @field_validator("backoff")
    @classmethod
    def _backoff(cls, value: float | None) -> float | None:
        if value is not None and value < 1:
            raise ValueError("backoff must be >= 1")
        return value

    @field_validator("priority")
    @classmethod
    def _priority(cls, value: int | None) -> int | None:
        if value is not None and not 1 <= value <= 5:
            raise ValueError("priority must be 1 (first) to 5 (last); 3 when unset")
        return value

    @field_validator("max_attempts")
    @classmethod
    def _attempts(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError("max_attempts must be >= 0 (0 means unlimited)")
        return value


class ActivityPolicy(BaseModel):
    start_to_close: timedelta
    heartbeat: timedelta | None
    retry: RetryPolicy
    # Which task queue runs it (temporal/queues.py): "main" (with the workflows, many I/O waits at
    # once), "cpu" (a few at a time), "llm" (model calls, bounded per model endpoint) or "vector"
    # (everything that opens the vector store).
    queue: queues.QueueKind = "main"
    # Temporal task-queue priority: among tasks waiting on one queue, lower numbers are handed out first
    # (the answer a person waits for before side steps that can come later).
    priority: int | None = None
    model_config = ConfigDict(arbitrary_types_allowed=True)

    def as_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"start_to_close_timeout": self.start_to_close, "retry_policy": self.retry}
        if self.heartbeat:
            options["heartbeat_timeout"] = self.heartbeat
        if self.priority is not None:
            options["priority"] = Priority(priority_key=self.priority)
        return options


class WorkflowPriorities(BaseModel):
    """[workflows]: the priority of the workflows Ragline's workers start (1 first .. 5 last). Their
    workflow tasks, and their activities without a priority of their own, are handed out by it among
    tasks waiting on one queue. Unset: 3 (the jobs the API starts, sessions included, run at 3)."""
    model_config = ConfigDict(extra="forbid")

    tenant_gate: int | None = Field(None, ge=1, le=5)
    chat_turn: int | None = Field(None, ge=1, le=5)


@dataclass(frozen=True)
class LoadedPolicies:
    """What the worker read from the policy file at start."""
    activities: dict[str, ActivityPolicy]
    dead_letter_ttl: timedelta
    slot_sweep: timedelta
    session_check: timedelta
    session_idle: timedelta
    step_aside: timedelta
    subscriber_grace: timedelta
    heartbeat_every: timedelta
    heartbeat_few_model_slots: timedelta
    workflows: WorkflowPriorities


_loaded: LoadedPolicies | None = None
DEFAULT_DEAD_LETTER_TTL = timedelta(days=7)
DEFAULT_SLOT_SWEEP = timedelta(minutes=1)
DEFAULT_SESSION_CHECK = timedelta(minutes=1)
DEFAULT_SESSION_IDLE = timedelta(days=1)
DEFAULT_STEP_ASIDE = timedelta(minutes=2)
SESSION_KEYS = frozenset({"check", "idle", "step_aside"})
DEFAULT_SUBSCRIBER_GRACE = timedelta(milliseconds=500)
DEFAULT_HEARTBEAT_EVERY = timedelta(seconds=2)
DEFAULT_HEARTBEAT_FEW_MODEL_SLOTS = timedelta(milliseconds=500)
HEARTBEAT_KEYS = frozenset({"every", "few_model_slots"})


def activity_name(fn: Callable[..., Any]) -> str:
    """The registered name of an activity function or method (its `@activity.defn`)."""
    return activity._Definition.must_from_callable(fn).name


def parse(text: str, activities: Iterable[str], source: str = "policies") -> dict[str, ActivityPolicy]:
    """Policies for `activities` (the names the worker registers) from the text of a policy file."""
    known = frozenset(activities)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{source}: not valid TOML: {exc}") from None
    unknown_sections = set(raw) - {"defaults", "activities", "dead_letter", "running_slots", "sessions", "events",
                                  "heartbeats", "workflows"}
    if unknown_sections:
        raise PolicyError(f"{source}: unknown section(s): {', '.join(sorted(unknown_sections))}")
    try:
        defaults = _Partial(**raw.get("defaults", {}))
    except ValidationError as exc:
        raise PolicyError(f"{source}: [defaults]: {_explain(exc)}") from None
    if defaults.start_to_close is None:
        raise PolicyError(f"{source}: [defaults].start_to_close is required")
    sections = raw.get("activities", {})
    unknown = set(sections) - known
    if unknown:
        raise PolicyError(f"{source}: unknown activity: {', '.join(sorted(unknown))} "
                          f"(registered: {', '.join(sorted(known))})")
    policies: dict[str, ActivityPolicy] = {}
    for name in sorted(known):
        try:
            own = _Partial(**sections.get(name, {}))
        except ValidationError as exc:
            raise PolicyError(f"{source}: [activities.{name}]: {_explain(exc)}") from None
        merged = defaults.model_copy(update=own.model_dump(exclude_none=True))
        policies[name] = ActivityPolicy(
            start_to_close=merged.start_to_close,
            heartbeat=merged.heartbeat,
            retry=RetryPolicy(
                initial_interval=merged.initial_interval or timedelta(seconds=1),
                backoff_coefficient=merged.backoff or 2.0,
                maximum_interval=merged.max_interval,
                maximum_attempts=merged.max_attempts or 0,
                non_retryable_error_types=list(merged.non_retryable or []),
            ),
            queue=merged.queue or "main",
            priority=merged.priority,
        )
        if (problem := _problem(policies[name])) is not None:
            # Said at start: Temporal refuses such a policy only when a job schedules the activity, and the
            # job then waits for ever, `queued`, its workflow task failing.
            raise PolicyError(f"{source}: [activities.{name}] (with [defaults]): {problem}")
    return policies


def _problem(policy: ActivityPolicy) -> str | None:
    if policy.start_to_close <= timedelta(0):
        return "start_to_close must be positive"
    if policy.heartbeat is not None and policy.heartbeat <= timedelta(0):
        return "heartbeat must be positive"
    try:
        policy.retry._validate()  # the SDK's own check, run when it schedules the activity
    except ValueError as exc:
        return f"retry: {exc}"
    known = _error_types(RaglineError)
    unknown = sorted(set(policy.retry.non_retryable_error_types or []) - known)
    if unknown:  # a misspelt name would silently retry the errors it meant
        return f"non_retryable: not an error type: {', '.join(unknown)} (ragline/errors.py: {', '.join(sorted(known))})"
    return None


def _error_types(cls: type) -> set[str]:
    """The names of `cls`'s subclasses, theirs included."""
    return {name for sub in cls.__subclasses__() for name in (sub.__name__, *_error_types(sub))}


def _explain(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors())


def parse_dead_letter_ttl(text: str, source: str = "policies", override: str | None = None) -> timedelta:
    """[dead_letter].ttl of the file, unless RAGLINE_DEAD_LETTER_TTL (`override`) says otherwise."""
    section = tomllib.loads(text).get("dead_letter", {})
    unknown = set(section) - {"ttl"}
    if unknown:
        raise PolicyError(f"{source}: [dead_letter]: unknown key: {', '.join(sorted(unknown))}")
    value = override if override is not None else section.get("ttl")
    if value is None:
        return DEFAULT_DEAD_LETTER_TTL
    try:
        ttl = parse_duration(value)
    except ValueError as exc:
        where = "RAGLINE_DEAD_LETTER_TTL" if override is not None else f"{source}: [dead_letter].ttl"
        raise PolicyError(f"{where}: {exc}") from None
    if ttl <= timedelta(0):
        raise PolicyError(f"{source}: [dead_letter].ttl must be positive")
    return ttl


def _positive_duration(text: str, source: str, section_name: str, key: str, default: timedelta,
                       section_keys: frozenset[str] = frozenset()) -> timedelta:
    """A key of a section of durations (`section_keys`, when it has more than this one), a positive duration;
    `default` when it is left out."""
    section = tomllib.loads(text).get(section_name, {})
    unknown = set(section) - {key} - section_keys
    if unknown:
        raise PolicyError(f"{source}: [{section_name}]: unknown key: {', '.join(sorted(unknown))}")
    if key not in section:
        return default
    try:
        value = parse_duration(section[key])
    except ValueError as exc:
        raise PolicyError(f"{source}: [{section_name}].{key}: {exc}") from None
    if value <= timedelta(0):
        raise PolicyError(f"{source}: [{section_name}].{key} must be positive")
    return value


def parse_slot_sweep(text: str, source: str = "policies") -> timedelta:
    """[running_slots].sweep: how often a tenant's gate, while jobs wait, checks its holders still run."""
    return _positive_duration(text, source, "running_slots", "sweep", DEFAULT_SLOT_SWEEP)


def parse_session_check(text: str, source: str = "policies") -> timedelta:
    """[sessions].check: how soon a chat turn waiting for its session's go first checks that the session
    still runs (then ever less often: workflows/chat.py)."""
    return _positive_duration(text, source, "sessions", "check", DEFAULT_SESSION_CHECK, SESSION_KEYS)


def parse_session_idle(text: str, source: str = "policies") -> timedelta:
    """[sessions].idle: how long a chat session waits for its next message before it ends (a later message
    starts it again with what it had: workflows/chat.py)."""
    return _positive_duration(text, source, "sessions", "idle", DEFAULT_SESSION_IDLE, SESSION_KEYS)


def parse_step_aside(text: str, source: str = "policies") -> timedelta:
    """[sessions].step_aside: the longest a turn's summary and entities, stopped for a later turn's answer on a
    small model endpoint, wait to be told that answer is out before they run again anyway (workflows/chat.py)."""
    return _positive_duration(text, source, "sessions", "step_aside", DEFAULT_STEP_ASIDE, SESSION_KEYS)


def parse_subscriber_grace(text: str, source: str = "policies") -> timedelta:
    """[events].subscriber_grace: how long an ending job that someone watches waits for the stream's
    next poll, so that its terminal event leaves with its last workflow task (workflows/events.py)."""
    return _positive_duration(text, source, "events", "subscriber_grace", DEFAULT_SUBSCRIBER_GRACE)


def parse_heartbeat_every(text: str, source: str = "policies") -> timedelta:
    """[heartbeats].every: how often a long activity tells the server it is alive, and so how soon it
    learns that its job was cancelled or has ended (activities/heartbeats.py)."""
    return _positive_duration(text, source, "heartbeats", "every", DEFAULT_HEARTBEAT_EVERY, HEARTBEAT_KEYS)


def parse_heartbeat_few_model_slots(text: str, source: str = "policies") -> timedelta:
    """[heartbeats].few_model_slots: how often model calls beat on a worker with no more model slots than a chat
    turn's side steps: a side step stopped for a later turn's answer (workflows/chat.py) learns it that soon."""
    return _positive_duration(text, source, "heartbeats", "few_model_slots", DEFAULT_HEARTBEAT_FEW_MODEL_SLOTS,
                              HEARTBEAT_KEYS)


def parse_workflow_priorities(text: str, source: str = "policies") -> WorkflowPriorities:
    try:
        return WorkflowPriorities(**tomllib.loads(text).get("workflows", {}))
    except ValidationError as exc:
        raise PolicyError(f"{source}: [workflows]: {_explain(exc)}") from None


def load(path: Path | None, activities: Iterable[str], *,
         dead_letter_ttl: str | None = None) -> dict[str, ActivityPolicy]:
    """Read and validate the policy file for the registered `activities`; called once by the worker
    before it polls."""
    global _loaded
    path = Path(path) if path else DEFAULT_FILE
    try:
        text = path.read_text()
    except OSError as exc:
        raise PolicyError(f"cannot read policy file {path}: {exc}") from None
    parsed = parse(text, activities, str(path))
    every = parse_heartbeat_every(text, str(path))
    # A beat may come a little late on a busy worker: a timeout of under three beats would fail
    # attempts that are alive.
    tight = sorted(name for name, p in parsed.items() if p.heartbeat is not None and p.heartbeat < 3 * every)
    if tight:
        raise PolicyError(f"{path}: heartbeat under three times [heartbeats] every ({every}): {', '.join(tight)}")
    _loaded = LoadedPolicies(activities=parsed,
                             dead_letter_ttl=parse_dead_letter_ttl(text, str(path), dead_letter_ttl),
                             slot_sweep=parse_slot_sweep(text, str(path)),
                             session_check=parse_session_check(text, str(path)),
                             session_idle=parse_session_idle(text, str(path)),
                             step_aside=parse_step_aside(text, str(path)),
                             subscriber_grace=parse_subscriber_grace(text, str(path)),
                             heartbeat_every=every,
                             heartbeat_few_model_slots=parse_heartbeat_few_model_slots(text, str(path)),
                             workflows=parse_workflow_priorities(text, str(path)))
    return _loaded.activities


def loaded() -> LoadedPolicies:
    if _loaded is None:
        raise PolicyError("policies not loaded: the worker must call temporal.policies.load() at start")
    return _loaded


def dead_letter_ttl() -> timedelta:
    """How long a dead-lettered job waits for an operator before it ends as failed."""
    return loaded().dead_letter_ttl


def slot_sweep_interval() -> timedelta:
    return loaded().slot_sweep


def session_check() -> timedelta:
    return loaded().session_check


def session_idle() -> timedelta:
    return loaded().session_idle


def step_aside() -> timedelta:
    return loaded().step_aside


def subscriber_grace() -> timedelta:
    return loaded().subscriber_grace


def heartbeat_every() -> timedelta:
    return loaded().heartbeat_every


def model_call_beat(model_slots: int) -> timedelta:
    """How often a model call heartbeats on a worker making `model_slots` calls at once."""
    few = model_slots <= SIDE_STEPS
    return loaded().heartbeat_few_model_slots if few else loaded().heartbeat_every


def fair_share(tenant: str, weight: float | None = None) -> Priority:
    """The priority every job of `tenant` starts with: the tenant is its fairness key, so the server hands
    out each queue's waiting tasks in turn among the tenants that have some, rather than first come first
    served (one tenant's upload of a hundred files does not hold up another's one question). `weight`
    (`[tenants.<name>] fairness_weight`, default 1) is how many turns the tenant gets for each turn of a
    tenant of weight 1. Children and activities inherit both; priority keys still go first. Needs
    `matching.enableFairness` on the server."""
    return Priority(fairness_key=tenant, fairness_weight=weight)


def turn_priority(tenant: str, fairness_weight: float | None) -> Priority:
    """A chat turn's job: the chat turns' priority key, and its tenant's fairness weight as of the turn's
    request (a session started with another weight would otherwise hand its own down to every turn)."""
    priority = workflow_priority("chat_turn")
    if fairness_weight is None:
        return priority  # the weight (and key) the session has
    return dataclasses.replace(priority, fairness_key=tenant, fairness_weight=fairness_weight)


def workflow_priority(kind: Literal["tenant_gate", "chat_turn"]) -> Priority:
    """The priority to start a workflow of this kind with ([workflows] of the policy file)."""
    key = getattr(loaded().workflows, kind)
    return Priority(priority_key=key) if key is not None else Priority.default


def policy(name: str) -> ActivityPolicy:
    try:
        return loaded().activities[name]
    except KeyError:
        raise PolicyError(f"no policy for activity {name!r}: it is not registered with this worker") from None


def options(name: str) -> dict[str, Any]:
    """Keyword arguments for `workflow.execute_activity*` (call from workflow code)."""
    from temporalio import workflow

    chosen = policy(name)
    opts = chosen.as_options()
    opts["task_queue"] = queues.queue_name(workflow.info().task_queue, chosen.queue)
    return opts


def local_options(name: str) -> dict[str, Any]:
    """Keyword arguments for `workflow.execute_local_activity*` (runs in the workflow's worker)."""
    return policy(name).as_options()


def execute(activity: Callable[..., Any], arg: Any, **extra: Any) -> Any:
    """From workflow code: run an activity, called by reference, under its policy (an awaitable);
    `extra` adds start options no policy holds (a cancellation type), never a timeout or a retry."""
    from temporalio import workflow

    return workflow.execute_activity_method(activity, arg, **options(activity_name(activity)), **extra)


def execute_local(activity: Callable[..., Any], arg: Any) -> Any:
    """From workflow code: run an activity as a local activity, in the workflow's worker, under its policy."""
    from temporalio import workflow

    return workflow.execute_local_activity_method(activity, arg, **local_options(activity_name(activity)))
