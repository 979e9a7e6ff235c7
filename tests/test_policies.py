"""The declarative policy file: every activity is covered, and a bad file stops the worker at start."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from temporal import policies

PROJECT = Path(__file__).resolve().parent.parent


def test_default_file_covers_every_activity_with_timeouts():
    text = policies.DEFAULT_FILE.read_text()
    parsed = policies.parse(text)
    assert set(parsed) == policies.KNOWN_ACTIVITIES
    for name, policy in parsed.items():
        assert policy.start_to_close > timedelta(0), name
        assert "InputError" in policy.retry.non_retryable_error_types, name
    # Long activities heartbeat.
    for name in ("extract_text", "embed_chunks", "generate_answer", "await_document", "await_turn"):
        assert parsed[name].heartbeat is not None, name
    assert parsed["extract_text"].retry.maximum_attempts == 3
    assert policies.parse_dead_letter_ttl(text) == timedelta(days=7)
    assert policies.parse_dead_letter_ttl(text, override="12h") == timedelta(hours=12)


def test_worker_registers_an_activity_for_every_policy_and_back():
    from activities.agent import AgentActivities
    from activities.chat import ChatActivities
    from activities.ingest import IngestActivities
    from activities.jobs import JobActivities
    from activities.search import SearchActivities

    names = set()
    for cls in (AgentActivities, ChatActivities, IngestActivities, JobActivities, SearchActivities):
        for attr in vars(cls).values():
            defn = getattr(attr, "__temporal_activity_definition", None)
            if defn is not None:
                names.add(defn.name)
    assert names == policies.KNOWN_ACTIVITIES


@pytest.mark.parametrize("text, named", [
    ('[defaults]\nstart_to_close = "1m"\n[activities.extract_txt]\nmax_attempts = 2', "extract_txt"),
    ('[defaults]\nstart_to_close = "1m"\n[activities.chunk_text]\nretries = 2', "retries"),
    ('[defaults]\nstart_to_close = "1m"\n[activities.chunk_text]\ninitial_interval = "-1s"', "initial_interval"),
    ('[defaults]\nstart_to_close = "1m"\n[activities.chunk_text]\nmax_attempts = -1', "max_attempts"),
    ('[defaults]\nstart_to_close = "1m"\nbackoff = 0.5', "backoff"),
    ('[defaults]\nstart_to_close = "soon"', "start_to_close"),
    ('[defaults]\nstart_to_close = "1m"\n[dead_letters]\nttl = "1d"', "dead_letters"),
])
def test_bad_policy_files_are_refused_naming_the_key(text, named):
    with pytest.raises(policies.PolicyError, match=named):
        policies.parse(text)
        policies.parse_dead_letter_ttl(text)


def test_worker_with_a_bad_policy_file_stops_at_start(tmp_path):
    bad = tmp_path / "policies.toml"
    bad.write_text('[defaults]\nstart_to_close = "1m"\n[activities.generate_answer]\nheartbeat = "-5s"\n')
    env = {**os.environ, "RAGLINE_POLICIES": str(bad), "RAGLINE_DATA_DIR": str(tmp_path),
           "RAGLINE_TEMPORAL_ADDRESS": "127.0.0.1:1"}
    proc = subprocess.run([sys.executable, "worker.py"], cwd=PROJECT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    output = proc.stdout + proc.stderr
    assert "generate_answer" in output and "heartbeat" in output
    assert "Traceback" not in output
