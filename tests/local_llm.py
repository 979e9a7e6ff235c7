"""The real local chat model for end-to-end tests: llama.cpp serving Qwen2.5-Coder-0.5B-Instruct.

    base_url, stop = start_local_llm(model_dir())
    try:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        ...
    finally:
        stop()

The model file is assembled (and verified) once into `model_dir()`: RAGLINE_TEST_MODEL_DIR, default
<project>/.venv/models-cache, so a fresh clone (CI) assembles it once per run and a developer once.
Tests that need it should skip with `local_llm_unavailable()` as the reason when it is not None.
To share one server between several test modules, wrap start_local_llm in a session fixture in
conftest.py (starting it takes a few seconds and ~1 GB of memory).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from devtools.localmodel import DEFAULT_MODEL, ensure_model, get_model, llama_server_argv, missing_packages
from ragline.settings import Settings

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def model_dir() -> Path:
    return Path(os.environ.get("RAGLINE_TEST_MODEL_DIR") or PROJECT_ROOT / ".venv" / "models-cache")


def local_llm_unavailable(key: str = DEFAULT_MODEL, directory: Path | None = None) -> str | None:
    """Why the real local model cannot run here (a skip reason), or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (`make test` installs the extra local-llm)"
    model = get_model(key)
    assembled = (directory or model_dir()) / model.filename
    missing = missing_packages(model)
    if missing and not (assembled.is_file() and assembled.stat().st_size == model.size):
        return f"the chunk packages of {key} are not installed ({missing[0]}, ...)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_llm(directory: Path | None = None, *, key: str = DEFAULT_MODEL,
                    ready_timeout: float = 300.0) -> tuple[str, Callable[[], None]]:
    """Assemble/reuse the model in `directory`, start llama.cpp on a free port and wait until
    GET /v1/models answers 200. Returns (base_url ending in /v1, stop)."""
    directory = Path(directory) if directory is not None else model_dir()
    # One thread: the tests beside it (the other pytest process, Temporal, workers) take cores at any
    # moment, and two spinning llama.cpp threads slowed down far more than one does (a test took 74 s
    # instead of 35 s with one core busy; alone, 10 s either way).
    settings = Settings(local_model=key, llm_port=_free_port(), local_model_threads=1)
    model_path = ensure_model(settings, models_dir=directory)
    log = tempfile.NamedTemporaryFile(prefix="ragline-llm-", suffix=".log", delete=False)
    proc = subprocess.Popen(llama_server_argv(settings, model_path), stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{settings.llm_port}/v1"

    def stop() -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
        Path(log.name).unlink(missing_ok=True)

    def log_tail() -> str:
        return "\n".join(Path(log.name).read_text(errors="replace").splitlines()[-30:])

    deadline = time.monotonic() + ready_timeout
    with httpx.Client(timeout=2.0, trust_env=False) as http:
        while True:
            if proc.poll() is not None:
                tail = log_tail()
                stop()
                raise RuntimeError(f"llama.cpp server exited with {proc.returncode}:\n{tail}")
            try:
                if http.get(f"{base_url}/models").status_code == 200:
                    return base_url, stop
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                tail = log_tail()
                stop()
                raise RuntimeError(f"llama.cpp server not ready within {ready_timeout:.0f} s:\n{tail}")
            time.sleep(0.25)
