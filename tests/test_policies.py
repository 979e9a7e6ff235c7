"""The declarative policy file: every registered activity is covered, and a bad file stops the worker at start."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from datetime import timedelta
from pathlib import Path

import re

import pytest

import worker
from temporal import policies

PROJECT = Path(__file__).resolve().parent.parent
FAST_POLICIES = Path(__file__).resolve().parent / "fast_policies.toml"
NAMES = worker.activity_names()
MINIMAL = '[defaults]\nstart_to_close = "1m"\n'


def test_default_file_sets_timeouts_retries_and_queues():
    text = policies.DEFAULT_FILE.read_text()
    parsed = policies.parse(text, NAMES)
    for name, policy in parsed.items():
        assert policy.start_to_close > timedelta(0), name
        assert "InputError" in policy.retry.non_retryable_error_types, name
    # Long activities heartbeat.
    for name in ("extract_text", "embed_chunks", "generate_answer", "await_document", "await_turn"):
        assert parsed[name].heartbeat is not None, name
    assert parsed["extract_text"].retry.maximum_attempts == 3
    # Waiting on another job, for a running slot, or for what an idle session left (turns wait on it) never
    # gives up; everything else does.
    never_gives_up = ("acquire_slot", "session_left")
    assert all(parsed[name].retry.maximum_attempts == 0 for name in ("await_document", *never_gives_up))
    assert all(p.retry.maximum_attempts > 0 for n, p in parsed.items()
               if not n.startswith("await_") and n not in never_gives_up)
    # Model calls go to the llm queue, CPU work to the cpu queue, whatever opens the store to the vector queue.
    for name in ("generate_answer", "summarize_context", "extract_entities", "agent_plan"):
        assert parsed[name].queue == "llm", name
    for name in ("extract_text", "chunk_text", "embed_chunks"):
        assert parsed[name].queue == "cpu", name
    for name in ("index_chunks", "prune_stale_chunks", "retrieve_context", "search_documents", "search_chunks"):
        assert parsed[name].queue == "vector", name
    assert policies.parse_dead_letter_ttl(text) == timedelta(days=7)
    assert policies.parse_dead_letter_ttl(text, override="12h") == timedelta(hours=12)
    assert policies.parse_slot_sweep(text) == timedelta(minutes=1)
    assert policies.parse_subscriber_grace(text) == timedelta(milliseconds=500)
    assert policies.parse_session_idle(text) == timedelta(days=1)


def test_test_policies_name_the_same_activities_on_the_same_queues():
    default = policies.parse(policies.DEFAULT_FILE.read_text(), NAMES)
    fast = policies.parse(FAST_POLICIES.read_text(), NAMES)
    assert {n: p.queue for n, p in fast.items()} == {n: p.queue for n, p in default.items()}
    assert {n: p.heartbeat is not None for n, p in fast.items()} == \
        {n: p.heartbeat is not None for n, p in default.items()}


def test_an_activity_without_a_section_gets_the_defaults():
    parsed = policies.parse(MINIMAL + "max_attempts = 7\n[activities.chunk_text]\nmax_attempts = 2\n", NAMES)
    assert parsed["chunk_text"].retry.maximum_attempts == 2
    assert parsed["embed_chunks"].retry.maximum_attempts == 7
    assert parsed["embed_chunks"].start_to_close == timedelta(minutes=1)
    assert parsed["embed_chunks"].queue == "main"


@pytest.mark.parametrize("text, named", [
    (MINIMAL + "[activities.extract_txt]\nmax_attempts = 2", "extract_txt"),
    (MINIMAL + "[activities.chunk_text]\nretries = 2", "retries"),
    (MINIMAL + '[activities.chunk_text]\ninitial_interval = "-1s"', "initial_interval"),
    (MINIMAL + "[activities.chunk_text]\nmax_attempts = -1", "max_attempts"),
    (MINIMAL + '[activities.chunk_text]\nqueue = "gpu"', "queue"),
    (MINIMAL + "backoff = 0.5", "backoff"),
    ('[defaults]\nstart_to_close = "soon"', "start_to_close"),
    ('[defaults]\nmax_attempts = 2', "start_to_close"),
    (MINIMAL + '[dead_letters]\nttl = "1d"', "dead_letters"),
    (MINIMAL + "[activities.chunk_text\n", "not valid TOML"),
])
def test_bad_policy_sections_are_refused_naming_the_key(text, named):
    with pytest.raises(policies.PolicyError, match=named):
        policies.parse(text, NAMES)


@pytest.mark.parametrize("section, named", [
    ('[dead_letter]\nttl = "soon"', r"\[dead_letter\]\.ttl: not a duration"),
    ('[dead_letter]\nttl = "0s"', r"\[dead_letter\]\.ttl must be positive"),
    ('[dead_letter]\nttl = "-1d"', r"\[dead_letter\]\.ttl"),
    ('[dead_letter]\nkeep = "1d"', r"\[dead_letter\]: unknown key: keep"),
])
def test_bad_dead_letter_sections_are_refused_naming_the_key(section, named):
    text = MINIMAL + section
    policies.parse(text, NAMES)  # the activity policies themselves are fine
    with pytest.raises(policies.PolicyError, match=named):
        policies.parse_dead_letter_ttl(text)


def test_a_bad_dead_letter_override_names_the_variable():
    with pytest.raises(policies.PolicyError, match="RAGLINE_DEAD_LETTER_TTL"):
        policies.parse_dead_letter_ttl(MINIMAL, override="a week")
    assert policies.parse_dead_letter_ttl(MINIMAL) == policies.DEFAULT_DEAD_LETTER_TTL


def test_a_section_for_an_activity_the_worker_does_not_register_stops_loading(tmp_path, restore_policies):
    # extract_text was renamed in code (say to extract_pages) but its section still names the old name:
    # loading stops instead of the renamed activity silently running on [defaults].
    renamed = [("extract_pages" if n == "extract_text" else n) for n in NAMES]
    for path in (policies.DEFAULT_FILE, FAST_POLICIES):
        with pytest.raises(policies.PolicyError, match="unknown activity: extract_text") as refused:
            policies.load(path, renamed)
        assert str(path) in str(refused.value)
        assert "extract_pages" in str(refused.value)  # the registered names are listed to compare

    # The same file loads for the names the worker registers, and the loaded policies are the file's.
    loaded = policies.load(FAST_POLICIES, NAMES, dead_letter_ttl="2h")
    assert policies.policy("extract_text") is loaded["extract_text"]
    assert policies.dead_letter_ttl() == timedelta(hours=2)
    with pytest.raises(policies.PolicyError, match="extract_pages"):
        policies.policy("extract_pages")


def test_load_reports_a_missing_file(tmp_path):
    with pytest.raises(policies.PolicyError, match="cannot read policy file"):
        policies.load(tmp_path / "nowhere.toml", NAMES)


def test_every_section_of_the_shipped_files_names_a_registered_activity():
    for path in (policies.DEFAULT_FILE, FAST_POLICIES):
        sections = set(tomllib.loads(path.read_text()).get("activities", {}))
        assert sections <= set(NAMES), (path, sections - set(NAMES))


@pytest.mark.parametrize("bad, named", [
    ('[defaults]\nstart_to_close = "1m"\n[activities.generate_answer]\nheartbeat = "-5s"\n', "heartbeat"),
    ('[defaults]\nstart_to_close = "1m"\n[activities.generate_answers]\nheartbeat = "5s"\n', "generate_answers"),
])
def test_worker_with_a_bad_policy_file_stops_at_start(tmp_path, bad, named):
    path = tmp_path / "policies.toml"
    path.write_text(bad)
    env = {**os.environ, "RAGLINE_POLICIES": str(path), "RAGLINE_DATA_DIR": str(tmp_path),
           "RAGLINE_TEMPORAL_ADDRESS": "127.0.0.1:1"}
    proc = subprocess.run([sys.executable, "worker.py"], cwd=PROJECT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    output = proc.stdout + proc.stderr
    assert named in output and "invalid policy file" in output
    assert "Traceback" not in output


def test_priority_orders_tasks_on_a_queue_and_is_checked():
    parsed = policies.parse(policies.DEFAULT_FILE.read_text(), worker.activity_names())
    # The answer a person waits for is handed out before the side steps waiting on the same queue.
    answer = parsed["generate_answer"].as_options()["priority"].priority_key
    side = [parsed[n].as_options()["priority"].priority_key for n in ("summarize_context", "extract_entities")]
    assert parsed["generate_answer"].queue == parsed["summarize_context"].queue == "llm"
    assert all(answer < p for p in side)
    assert "priority" not in parsed["chunk_text"].as_options()
    with pytest.raises(policies.PolicyError, match="priority"):
        policies.parse('[defaults]\nstart_to_close = "1m"\n[activities.chunk_text]\npriority = 9\n',
                       worker.activity_names())


def test_the_policy_file_puts_the_gate_then_chat_turns_ahead_of_other_workflows():
    shipped = policies.parse_workflow_priorities(policies.DEFAULT_FILE.read_text())
    assert shipped.tenant_gate < shipped.chat_turn < 3  # 3: the sessions and the jobs the API starts
    assert policies.parse_workflow_priorities(MINIMAL) == policies.WorkflowPriorities()
    for bad, named in (("chat_turn = 0", "chat_turn"), ("chat_turn = 6", "chat_turn"),
                       ("ingest = 4", "ingest")):
        with pytest.raises(policies.PolicyError, match=rf"\[workflows\]: {named}"):
            policies.parse_workflow_priorities(MINIMAL + f"[workflows]\n{bad}\n")


def test_the_workflow_timeouts_of_the_policy_file_have_defaults_and_must_be_positive():
    assert policies.parse_slot_sweep(MINIMAL) == policies.DEFAULT_SLOT_SWEEP
    assert policies.parse_subscriber_grace(MINIMAL) == policies.DEFAULT_SUBSCRIBER_GRACE
    assert policies.parse_subscriber_grace(MINIMAL + '[events]\nsubscriber_grace = "2s"\n') == timedelta(seconds=2)
    for bad, named in (('subscriber_grace = "0s"', "must be positive"), ('subscriber_grace = "soon"', "not a duration"),
                       ('grace = "1s"', "unknown key: grace")):
        with pytest.raises(policies.PolicyError, match=named):
            policies.parse_subscriber_grace(MINIMAL + f"[events]\n{bad}\n")
    # [sessions] has two keys: each is read alone, and a third is refused by both.
    both = MINIMAL + '[sessions]\ncheck = "2m"\nidle = "3h"\n'
    assert (policies.parse_session_check(both), policies.parse_session_idle(both)) == (timedelta(minutes=2),
                                                                                      timedelta(hours=3))
    assert policies.parse_session_idle(MINIMAL) == policies.DEFAULT_SESSION_IDLE
    for parse in (policies.parse_session_check, policies.parse_session_idle):
        with pytest.raises(policies.PolicyError, match="unknown key: idel"):
            parse(MINIMAL + '[sessions]\nidel = "1h"\n')
    with pytest.raises(policies.PolicyError, match=r"\[sessions\]\.idle must be positive"):
        policies.parse_session_idle(MINIMAL + '[sessions]\nidle = "0s"\n')
    assert policies.parse_step_aside(MINIMAL) == policies.DEFAULT_STEP_ASIDE
    assert policies.parse_step_aside(both + 'step_aside = "30s"\n') == timedelta(seconds=30)


def test_model_calls_beat_sooner_on_a_worker_of_no_more_model_slots_than_a_turns_side_steps(restore_policies):
    """Where a turn's side steps step aside for a later answer (a local model), their stop reaches them within a
    beat; elsewhere model calls beat as every long activity does."""
    shipped = policies.DEFAULT_FILE.read_text()
    assert policies.parse_heartbeat_few_model_slots(shipped) == timedelta(milliseconds=500)
    assert policies.parse_heartbeat_few_model_slots(MINIMAL) == policies.DEFAULT_HEARTBEAT_FEW_MODEL_SLOTS
    with pytest.raises(policies.PolicyError, match="unknown key: evry"):
        policies.parse_heartbeat_every(MINIMAL + '[heartbeats]\nevry = "1s"\n')
    policies.load(policies.DEFAULT_FILE, NAMES)
    assert [policies.model_call_beat(n) for n in (1, 2, 3, 64)] == [timedelta(milliseconds=500)] * 2 + [
        timedelta(seconds=2)] * 2


def _duration(d: timedelta | None) -> str:
    if d is None:
        return "–"
    seconds = d.total_seconds()
    for unit, size in (("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds * 1000)}ms"


def _policy_rows() -> list[str]:
    """README's table of the shipped policies, row by row, as the policy file gives them."""
    text = policies.DEFAULT_FILE.read_text()
    parsed = policies.parse(text, NAMES)
    order = list(tomllib.loads(text)["activities"])
    rows = []
    for name in order:
        p = parsed[name]
        r = p.retry
        attempts = "unlimited" if not r.maximum_attempts else str(r.maximum_attempts)
        backoff = f"{_duration(r.initial_interval)} × {r.backoff_coefficient:g}, max {_duration(r.maximum_interval)}"
        rows.append(f"| `{name}` | {p.queue} | {p.priority or '–'} | {_duration(p.start_to_close)} | "
                    f"{_duration(p.heartbeat)} | {attempts} | {backoff} |")
    return rows


def test_the_readme_table_of_policies_is_the_policy_file():
    readme = (PROJECT / "README.md").read_text()
    documented = [line for line in readme.splitlines() if line.startswith("| `") and " × " in line]
    expected = _policy_rows()
    assert documented == expected, "README's policy table is stale; the file says:\n" + "\n".join(expected)


def test_a_review_timeout_that_is_no_duration_stops_the_process_at_start():
    from pydantic import ValidationError

    from ragline.settings import Settings

    assert Settings(review_timeout="90m").review_timeout == "90m"
    for bad in ("1 day", "0s", "-5m"):
        with pytest.raises(ValidationError, match="review_timeout"):
            Settings(review_timeout=bad)


def test_every_activity_that_heartbeats_has_a_heartbeat_timeout_a_few_beats_long(tmp_path, restore_policies):
    """An activity that heartbeats while it waits (activities/heartbeats.py) is declared with a heartbeat
    timeout: then a worker that dies under it is noticed within seconds, not after start_to_close
    (minutes for a model call). And a timeout under three beats, which a busy worker could miss, stops
    loading."""
    shipped = policies.parse(policies.DEFAULT_FILE.read_text(), NAMES)
    beating = ["generate_answer", "generate_answer_fallback", "summarize_context", "extract_entities",
               "agent_plan", "await_document", "await_turn", "evaluate_collection"]
    every = policies.parse_heartbeat_every(policies.DEFAULT_FILE.read_text())
    for name in beating:
        assert shipped[name].heartbeat is not None, name
        if name.startswith(("generate", "summarize", "extract", "agent")):  # model calls: a crash costs seconds
            assert shipped[name].heartbeat <= 10 * every, name
    tight = policies.DEFAULT_FILE.read_text().replace('[heartbeats]\nevery = "2s"', '[heartbeats]\nevery = "6s"')
    path = tmp_path / "policies.toml"
    path.write_text(tight)
    with pytest.raises(policies.PolicyError, match="generate_answer"):
        policies.load(path, NAMES)


@pytest.mark.parametrize(("section", "says"), [
    # inherits [defaults]' max_interval of 30s: Temporal refuses the policy, but only when a job schedules it
    ('[activities.extract_text]\ninitial_interval = "1m"\n', "Maximum interval cannot be less than initial interval"),
    ('[activities.extract_text]\nstart_to_close = "0s"\n', "start_to_close must be positive"),
    ('[activities.extract_text]\nheartbeat = "0s"\n', "heartbeat must be positive"),
    ('[activities.extract_text]\nbackoff = 0.5\n', "backoff must be >= 1"),
    ('[activities.extract_text]\nnon_retryable = ["InputErorr"]\n', "not an error type: InputErorr"),
])
def test_a_policy_temporal_would_refuse_at_schedule_time_stops_the_worker_at_start(section: str, says: str):
    """Such a policy passed the start, and every job that reached the activity then waited for ever, `queued`,
    its workflow task failing on the SDK's check."""
    text = MINIMAL.replace('start_to_close = "1m"\n', 'start_to_close = "1m"\nmax_interval = "30s"\n') + section
    with pytest.raises(policies.PolicyError, match=rf"\[activities\.extract_text\].*{re.escape(says)}"):
        policies.parse(text, NAMES)
    assert policies.parse(policies.DEFAULT_FILE.read_text(), NAMES)  # the shipped file passes
