"""Safe deploys: the histories recorded from real runs of every workflow type (tests/histories/, made by
`python -m tests.record_histories`) replay against today's workflow code without non-determinism. A
change that would break a running chat session or agent (both AUTO_UPGRADE to a new build) fails here."""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path

import pytest
from temporalio import workflow
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

import worker
from models.chat import KEY_EXPIRED_TYPE
from ragline.settings import Settings
from temporal import policies
from temporal.converter import build_data_converter
from tests.conftest import FIXTURES
from workflows.agent import (
    CANCELLED_CHILD_PATCH, CANCELLED_CHILD_SPEND_PATCH, CHILD_CANCEL_AFTER_START_PATCH, FAILED_CHILD_SPEND_PATCH,
    REVIEW_WAIT_NOT_CHARGED_PATCH, SECONDS_FROM_DECISION_PATCH, SLOT_WAIT_NOT_CHARGED_PATCH,
    UNANSWERED_PLAN_ATTEMPTS_PATCH,
)
from workflows.chat import (
    CANCELLED_TURN_ANSWER_PATCH, CANCELLED_TURN_WAITS_FOR_ITS_ANSWER_PATCH, CARRIED_TURN_ASKED_PATCH,
    REFUSAL_TOLD_PATCH, RESENT_AFTER_GONE_PATCH, SESSION_CONTINUES_MID_TURN_PATCH, SESSION_ENDS_IDLE_PATCH,
    SESSION_REFUSES_PATCH, ChatTurnWorkflow,
)
from workflows.dead_letters import WITHDRAWN_WHEN_STOPPING_PATCH
from workflows.events import POLLS_BOUNDED_PATCH, TERMINAL_EVENT_STANDS_PATCH
from workflows.gate import IN_GATE_BOUND_PATCH, OWED_PATCH, SENDS_BOUNDED_PATCH
from workflows.ingest import (
    CANCEL_AFTER_START_PATCH, OWN_PASSWORD_PATCH, OWN_RUN_PATCH, PUBLISH_LANDED_PATCH, REMOVED_AGAIN_PATCH,
    REMOVED_PATCH,
)
from workflows.job import CANCEL_REQUESTED_IS_CANCEL_PATCH, FALLBACK_REFUSED_PARKS_PATCH, OPTIONAL_STEP_SKIPPED_PATCH
from workflows.remove import FINISHES_ONCE_CONFIRMED_PATCH, NEWER_RUN_ONLY_PATCH
from workflows.review import SECOND_DECISION_PATCH, WITHDRAWING_REFUSES_PATCH
from workflows.slot import GRANT_FINAL_PATCH

# policies.load is process-wide: put back what the session's in-process worker runs on.
pytestmark = pytest.mark.usefixtures("restore_policies")

HISTORIES = Path(__file__).resolve().parent / "histories"
FILES = sorted(HISTORIES.glob("*--*.json"))
# Histories recorded by earlier code and kept: jobs in flight during a deploy must go on replaying
# (a change guarded by `workflow.patched`, like running slots, keeps them valid).
EARLIER = sorted(HISTORIES.glob("before-*/*--*.json"))


def _patches(prefix: str) -> set[str]:
    """The patch ids the recorded histories whose names start with `prefix` carry (their markers' payloads)."""
    ids = set()
    for path in (p for p in FILES if p.name.startswith(prefix)):
        for event in json.loads(path.read_text())["events"]:
            marker = event.get("markerRecordedEventAttributes", {})
            if marker.get("markerName") == "core_patch":
                ids |= {json.loads(base64.b64decode(payload["data"]))["id"]
                        for payload in marker["details"]["patch-data"]["payloads"]}
    return ids


def _history(path: Path) -> WorkflowHistory:
    ids = json.loads((path.parent / "workflow_ids.json").read_text())
    return WorkflowHistory.from_json(ids[path.name], path.read_text())


@workflow.defn(name="IngestWorkflow", sandboxed=False)
class ChangedIngest:
    """An ingestion that no longer starts its children: what a careless change looks like."""

    @workflow.run
    async def run(self, req: dict) -> None:
        await workflow.sleep(1)


@pytest.fixture
def replayer(tmp_path, restore_policies) -> Replayer:
    policies.load(FIXTURES.parent / "fast_policies.toml", worker.activity_names())
    return Replayer(workflows=worker.WORKFLOWS, data_converter=build_data_converter(Settings(data_dir=tmp_path, encrypt_payloads=False)))


def test_every_workflow_type_and_scenario_is_recorded():
    types = {p.stem.split("--")[1] for p in FILES}
    assert types == {cls.__name__ for cls in worker.WORKFLOWS}
    scenarios = {p.stem.split("--")[0] for p in FILES}
    assert scenarios >= {"ingestion", "chat-session", "agent-review", "dead-letter-retry", "running-slots",
                         "follow-up-waits-for-go", "chat-cancelled-after-answer", "chat-cancel-with-ask",
                         "agent-seconds-granted", "chat-resent-after-gone", "chat-session-full-mid-turn",
                         "ingest-cancel-during-failing-publish", "chat-cancel-after-terminal-event",
                         "chat-stream-polls-bounded", "gate-full", "gate-ends-owing", "chat-fallback-refused",
                         "slot-grant-then-wait", "gate-sends-bounded", "chat-refusal-cache-down",
                         "agent-sub-agent-cancelled", "agent-cancel-while-sub-agent-starts",
                         "agent-stop-withdraws-parked-plan", "agent-review-signals-with-stop",
                         "ingest-reruns-anothers-document", "ingest-after-removal",
                         "ingest-cancel-while-document-starts", "ingest-published-as-cancel-came",
                         "ingest-removed-again", "removal-after-failed-newer-run"}
    slots = "".join(p.read_text() for p in FILES if p.stem.startswith("running-slots--"))
    assert "\"slot_update\"" in slots and "\"acquire\"" in slots  # a turn waited for its slot and got it
    session_runs = [json.loads(p.read_text()) for p in FILES if p.stem.startswith("chat-session--ChatSessionWorkflow")]
    assert any("workflowExecutionContinuedAsNewEventAttributes" in e for run in session_runs for e in run["events"])
    # Turns waiting after a running one asked it for its answer, which it told before its own end.
    first_turn = "".join(p.read_text() for p in FILES if p.stem.startswith("chat-session-first-turn--"))
    assert "\"follow_up_waits\"" in first_turn and "\"turn_answered\"" in first_turn
    agents = "".join(p.read_text() for p in FILES if p.stem.startswith("agent-review--"))
    assert '"review"' in agents  # the review update reached the tree
    # A follow-up waiting for its go behind a held turn looked whether its session still runs, then went on.
    waited = next(p for p in FILES if p.stem.startswith("follow-up-waits-for-go--ChatTurnWorkflow")).read_text()
    assert '"session_still_runs"' in waited and "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED" in waited
    parked = next(p for p in FILES if p.stem.startswith("dead-letter-retry--")).read_text()
    assert '"retry"' in parked
    # A turn cancelled after its answer was shown told its session (carried over a continue-as-new, the
    # session read it at the turn's end); one whose cancel came with the session's ask awaited that send.
    assert CANCELLED_TURN_ANSWER_PATCH in _patches("chat-cancelled-after-answer--ChatTurnWorkflow")
    assert CANCELLED_TURN_ANSWER_PATCH in _patches("chat-cancelled-after-answer--ChatSessionWorkflow")
    assert {CANCELLED_TURN_ANSWER_PATCH, CANCELLED_TURN_WAITS_FOR_ITS_ANSWER_PATCH} <= \
        _patches("chat-cancel-with-ask--ChatTurnWorkflow")
    asked = next(p for p in FILES if p.stem.startswith("chat-cancel-with-ask--ChatTurnWorkflow")).read_text()
    assert '"follow_up_waits"' in asked and "EVENT_TYPE_WORKFLOW_EXECUTION_CANCELED" in asked
    # Seconds a reviewer granted an agent out of time counted from the decision.
    assert SECONDS_FROM_DECISION_PATCH in _patches("agent-seconds-granted--")
    assert REVIEW_WAIT_NOT_CHARGED_PATCH in _patches("agent-review--")
    # A root agent's time starts once it holds its tenant's running slot (its wait for it is not charged).
    assert SLOT_WAIT_NOT_CHARGED_PATCH in _patches("agent-review--AgentWorkflow--1")
    # A removal carried on past a cancel once confirmed.
    assert FINISHES_ONCE_CONFIRMED_PATCH in _patches("removal--")
    # A removal whose newer run failed took only what was written before that run ended.
    assert NEWER_RUN_ONLY_PATCH in _patches("removal-after-failed-newer-run--RemoveDocumentWorkflow")
    # A session that ended idle (its state its result), and the run a later message started, which read it.
    assert SESSION_ENDS_IDLE_PATCH in _patches("chat-session-idle--")
    idle = "".join(p.read_text() for p in FILES if p.stem.startswith("chat-session-idle--"))
    assert '"session_left"' in idle and "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED" in idle
    # A keyed turn sent again once its job was gone (past a continue-as-new): its session started a job that
    # failed at once.
    assert RESENT_AFTER_GONE_PATCH in _patches("chat-resent-after-gone--ChatSessionWorkflow")
    refused = next(p for p in FILES if p.stem.startswith("chat-resent-after-gone--ChatTurnWorkflow")).read_text()
    assert KEY_EXPIRED_TYPE in refused and "EVENT_TYPE_WORKFLOW_EXECUTION_FAILED" in refused
    # A session holding its bound of turns refused the next, and continued as new while a reviewer held its
    # turn; its next run asked that carried turn for its answer.
    assert {SESSION_REFUSES_PATCH, SESSION_CONTINUES_MID_TURN_PATCH, CARRIED_TURN_ASKED_PATCH} <= \
        _patches("chat-session-full-mid-turn--ChatSessionWorkflow")
    # A publish cancelled as it ran, which then failed: the job ended cancelled.
    assert CANCEL_REQUESTED_IS_CANCEL_PATCH in _patches("ingest-cancel-during-failing-publish--IngestDocumentWorkflow")
    # A cancel that came once a watched turn's terminal event was out left it completed.
    assert TERMINAL_EVENT_STANDS_PATCH in _patches("chat-cancel-after-terminal-event--ChatTurnWorkflow")
    late = next(p for p in FILES if p.stem.startswith("chat-cancel-after-terminal-event--")).read_text()
    assert "EVENT_TYPE_WORKFLOW_EXECUTION_CANCEL_REQUESTED" in late
    assert "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED" in late
    # Polls of gone readers past five waiting were answered early.
    assert POLLS_BOUNDED_PATCH in _patches("chat-stream-polls-bounded--ChatTurnWorkflow")
    # A gate holding all it may refused the next job, which failed saying so.
    assert IN_GATE_BOUND_PATCH in _patches("gate-full--TenantGateWorkflow")
    assert "TenantBusy" in next(p for p in FILES if p.stem.startswith("gate-full--ChatTurnWorkflow")).read_text()
    # A job that asked as its gate was ending was owed its answer, told by the next run.
    assert OWED_PATCH in _patches("gate-ends-owing--TenantGateWorkflow")
    # An answer whose fallback model refused too was parked (then retried by an operator), not failed.
    assert FALLBACK_REFUSED_PARKS_PATCH in _patches("chat-fallback-refused--ChatTurnWorkflow")
    # A job that heard "wait in line" after its grant kept the slot.
    assert GRANT_FINAL_PATCH in _patches("slot-grant-then-wait--IngestDocumentWorkflow")
    # A gate owing more answers than it sends at once held the last back until one was through.
    assert SENDS_BOUNDED_PATCH in _patches("gate-sends-bounded--TenantGateWorkflow")
    # A refusal told its session at once; its cache write, out of retries, was left failed and the job completed.
    assert {REFUSAL_TOLD_PATCH, OPTIONAL_STEP_SKIPPED_PATCH} <= _patches("chat-refusal-cache-down--ChatTurnWorkflow")
    # A sub-agent a person cancelled told its parent what it spent; counted, its goal was not delegated again.
    assert {FAILED_CHILD_SPEND_PATCH, CANCELLED_CHILD_SPEND_PATCH, CANCELLED_CHILD_PATCH} <= \
        _patches("agent-sub-agent-cancelled--AgentWorkflow")
    # A sub-agent cancelled as it started its own waited for that start, then cancelled it.
    assert CHILD_CANCEL_AFTER_START_PATCH in _patches("agent-cancel-while-sub-agent-starts--AgentWorkflow")
    # A sub-agent told to stop withdrew its parked plan, whose attempts counted.
    assert {WITHDRAWN_WHEN_STOPPING_PATCH, UNANSWERED_PLAN_ATTEMPTS_PATCH} <= \
        _patches("agent-stop-withdraws-parked-plan--AgentWorkflow")
    # Decisions signalled with a stop: the rejection taken, the approval after it refused.
    assert {SECOND_DECISION_PATCH, WITHDRAWING_REFUSES_PATCH} <= \
        _patches("agent-review-signals-with-stop--AgentWorkflow")
    # Uploads reaching documents other uploads ran: run again when cancelled with theirs, failed on their
    # password, or removed since.
    assert {OWN_RUN_PATCH, OWN_PASSWORD_PATCH} <= _patches("ingest-reruns-anothers-document--IngestWorkflow")
    assert REMOVED_PATCH in _patches("ingest-after-removal--IngestWorkflow")
    # An upload whose document was removed again while it ran failed as Removed, not as the file's fault.
    assert REMOVED_AGAIN_PATCH in _patches("ingest-removed-again--IngestWorkflow")
    again = next(p for p in FILES if p.stem.startswith("ingest-removed-again--IngestWorkflow")).read_text()
    assert "EVENT_TYPE_WORKFLOW_EXECUTION_FAILED" in again and '"type": "Removed"' in again
    # An upload cancelled as its document's job started cancelled that job once started.
    assert CANCEL_AFTER_START_PATCH in _patches("ingest-cancel-while-document-starts--IngestWorkflow")
    # A publish that ended with the cancel in one workflow task: the document indexed.
    assert PUBLISH_LANDED_PATCH in _patches("ingest-published-as-cancel-came--IngestDocumentWorkflow")


# One replay worker per folder: a worker per history took 40 s for the 258 histories, a worker per folder 12 s.
FOLDERS = sorted({p.parent for p in FILES + EARLIER})


@pytest.mark.parametrize("folder", FOLDERS, ids=[f.name for f in FOLDERS])
async def test_recorded_histories_replay_without_nondeterminism(replayer, folder):
    histories = {path.name: _history(path) for path in FILES + EARLIER if path.parent == folder}
    names = {history.run_id: name for name, history in histories.items()}
    assert len(names) == len(histories), "two histories of one run in a folder"

    async def each():
        for history in histories.values():
            yield history

    replayed, failures = set(), {}
    async with replayer.workflow_replay_iterator(each()) as results:
        async for result in results:
            replayed.add(names[result.history.run_id])
            if result.replay_failure is not None:
                failures[names[result.history.run_id]] = result.replay_failure
    assert replayed == set(histories)
    assert not failures, "\n".join(f"{name}: {failure!r}" for name, failure in failures.items())


async def test_a_changed_workflow_fails_the_replay(tmp_path, restore_policies):
    """The guard works: an ingestion that no longer starts its children is caught."""
    policies.load(FIXTURES.parent / "fast_policies.toml", worker.activity_names())
    replayer = Replayer(workflows=[ChangedIngest], data_converter=build_data_converter(Settings(data_dir=tmp_path, encrypt_payloads=False)))
    path = next(p for p in FILES if p.stem.startswith("ingestion--IngestWorkflow"))
    result = await replayer.replay_workflow(_history(path), raise_on_replay_failure=False)
    assert result.replay_failure is not None


def _with_signal_before(history: dict, name: str, event_id: int) -> dict:
    """The history as if signal `name` (no input) had arrived just before event `event_id`."""
    history = copy.deepcopy(history)
    events = history["events"]
    signal = copy.deepcopy(next(e for e in events if "workflowExecutionSignaledEventAttributes" in e))
    signal["workflowExecutionSignaledEventAttributes"]["signalName"] = name
    signal["workflowExecutionSignaledEventAttributes"].pop("input", None)

    def shift(node) -> None:  # every event id (and reference to one) from event_id on moves up by one
        if isinstance(node, dict):
            for key, value in node.items():
                if (key == "eventId" or key.endswith("EventId")) and int(value) >= event_id:
                    node[key] = type(value)(int(value) + 1)
                else:
                    shift(value)
        elif isinstance(node, list):
            for item in node:
                shift(item)

    shift(events)
    signal["eventId"] = type(signal["eventId"])(event_id)
    events.insert(next(i for i, e in enumerate(events) if int(e["eventId"]) == event_id + 1), signal)
    return history


@pytest.mark.parametrize("event_id", [37, 44], ids=["before-the-answer-is-read", "during-the-side-steps"])
async def test_a_turn_asked_for_its_answer_on_an_older_worker_replays(replayer, event_id):
    """A rolling deploy: a session on new code asks a turn whose task ran on an older worker, which had no
    handler for the ask (the signal waited, unhandled). Replayed on new code, the turn tells nothing, as it
    ran; it must not send a signal its history never had (the session then reads the turn's end)."""
    path = HISTORIES / "before-next-turn-after-answer" / "chat-session--ChatTurnWorkflow--1.json"
    ids = json.loads((path.parent / "workflow_ids.json").read_text())
    events = json.loads(path.read_text())["events"]
    # Event 37 is the task that reads the answer; 44 the one after the first side step.
    assert "activityTaskCompletedEventAttributes" in events[35] and "workflowTaskScheduledEventAttributes" in events[43]
    # The handler's own name (signals are named after their method): a renamed handler would otherwise leave
    # the inserted signal unhandled, and the test passing for nothing.
    history = _with_signal_before(json.loads(path.read_text()), ChatTurnWorkflow.follow_up_waits.__name__, event_id)
    result = await replayer.replay_workflow(WorkflowHistory.from_json(ids[path.name], json.dumps(history)),
                                            raise_on_replay_failure=False)
    assert result.replay_failure is None, result.replay_failure
