"""`python -m bench sweep` (part of `make bench`): what the blob sweep (ragline/blob_sweep.py) costs.

The bench's stack (bench.run.Stack: dev server, worker, API, scripted model answering at once) runs
--chats chat turns (--sessions sessions) and --documents uploads, so the namespace holds their histories
and the blob store their blobs. Then:
  - the sweep as its schedule runs it, timed: workflows read, references found, blobs stored;
  - --turns chat turns one after another, alone, then again while sweeps run one after another beside
    them: what a sweep costs the people chatting meanwhile (p50 POST -> completed, each turn polled).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from bench import procs
from bench.procs import ROOT
from bench.report import write_section
from bench.run import COLLECTION, QUESTION, Stack, ingest, log, wait_job

HEADING = "## The blob sweep: what it reads, and what it costs a chat meanwhile"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--chats", type=int, default=400, help="chat turns run before the sweep (default 400)")
    p.add_argument("--sessions", type=int, default=40, help="sessions they are spread over (default 40)")
    p.add_argument("--documents", type=int, default=10, help="uploads before the sweep (default 10)")
    p.add_argument("--turns", type=int, default=20, help="turns timed alone, then beside sweeps (default 20)")
    p.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    p.add_argument("--no-write", action="store_true")
    return p.parse_args(argv)


async def _turn(http, session: str, i: int) -> float:  # noqa: ANN001
    began = time.perf_counter()
    r = await http.post("/v1/chats", json={"message": f"{QUESTION} (#{i})", "collection": COLLECTION,
                                           "session_id": session})
    r.raise_for_status()
    job = await wait_job(http, r.json()["job_id"], 120)
    if job["status"] != "completed":
        raise RuntimeError(f"turn ended {job['status']}: {job.get('error')}")
    return time.perf_counter() - began


async def _fill(stack: Stack, args: argparse.Namespace) -> None:
    """Histories and blobs: chats spread over sessions (each session's turns in order), and uploads."""
    async with procs.client(stack.api_url, 120, connections=args.sessions + 4) as http:
        per = max(1, args.chats // args.sessions)

        async def session(s: int) -> None:
            for i in range(per):
                await _turn(http, f"fill-{s}", i)

        async def upload(d: int) -> None:
            text = f"Document {d} of the sweep bench: the depot at pier {d} opens at {d % 12 + 1} o'clock. " * 20
            r = await http.post("/v1/documents", data={"collection": COLLECTION},
                                files=[("files", (f"pier-{d}.txt", text.encode(), "text/plain"))])
            r.raise_for_status()
            await wait_job(http, r.json()["job_id"], 300)

        await asyncio.gather(*(session(s) for s in range(args.sessions)), *(upload(d) for d in range(args.documents)))


async def run(args: argparse.Namespace) -> dict:
    from ragline.blob_sweep import sweep
    from ragline.blobstore import BlobStore
    from temporal.client import connect

    data = Path(tempfile.mkdtemp(prefix="ragline-bench-sweep-"))
    stack = Stack(data)
    try:
        await stack.start(delay=0.0)
        await ingest(stack.api_url)
        log(f"filling: {args.chats} chat turns over {args.sessions} sessions, {args.documents} uploads")
        began = time.perf_counter()
        await _fill(stack, args)
        filled = time.perf_counter() - began
        settings = stack.settings
        client = await connect(settings)
        store = BlobStore(settings.blob_dir)
        blob_bytes = sum(stat.st_size for _, stat in store.stored())
        sweeps = []
        for _ in range(3):
            began = time.perf_counter()
            report = await sweep(client, store, min_age=3600)
            sweeps.append((time.perf_counter() - began, report))
        async with procs.client(stack.api_url, 120) as http:
            alone = [await _turn(http, f"alone-{uuid.uuid4().hex[:6]}", i) for i in range(args.turns)]
            sweeping = asyncio.Event()
            beside_sweeps = 0

            async def keep_sweeping() -> None:
                nonlocal beside_sweeps
                while not sweeping.is_set():
                    await sweep(client, store, min_age=3600)
                    beside_sweeps += 1

            sweeper = asyncio.create_task(keep_sweeping())
            try:
                beside = [await _turn(http, f"beside-{uuid.uuid4().hex[:6]}", i) for i in range(args.turns)]
            finally:
                sweeping.set()
                await sweeper
        return {"chats": args.chats, "sessions": args.sessions, "documents": args.documents, "fill_seconds": filled,
                "blob_bytes": blob_bytes, "sweeps": [(s, r.model_dump()) for s, r in sweeps],
                "turn_alone_p50": statistics.median(alone), "turn_beside_p50": statistics.median(beside),
                "turns": args.turns, "sweeps_beside": beside_sweeps}
    finally:
        await stack.stop()


def render(result: dict) -> str:
    rows = "\n".join(
        f"| {i} | {r['workflows_read']} | {r['referenced']} | {r['stored']} | {r['kept_young']} | {r['deleted']} | "
        f"{seconds:.2f} s | {r['workflows_read'] / seconds:.0f} |"
        for i, (seconds, r) in enumerate(result["sweeps"], 1))
    alone, beside = result["turn_alone_p50"], result["turn_beside_p50"]
    return f"""{HEADING}

`python -m bench sweep` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, 2 CPUs; the bench's stack, the
scripted model answering at once). Before the sweep: {result['chats']} chat turns over {result['sessions']}
sessions and {result['documents']} uploads (filled in {result['fill_seconds']:.0f} s),
{result['blob_bytes'] / 1e6:.1f} MB of blobs. Each sweep reads every history of the namespace (and the pending
activities of open workflows) and marks the blobs they name; nothing was old enough to go (minimum age 1 h), so
this is the mark's cost.

| sweep | workflows read | references | blobs stored | unreferenced (young) | deleted | time | workflows/s |
| --- | --- | --- | --- | --- | --- | --- | --- |
{rows}

A chat turn (POST to `completed`, one at a time, p50 of {result['turns']}): {alone * 1000:.0f} ms alone,
{beside * 1000:.0f} ms while sweeps ran one after another beside it ({result['sweeps_beside']} sweeps), ratio
{beside / alone:.2f}. The schedule runs one sweep a day.
"""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    section = render(result)
    print(section)
    if not args.no_write:
        write_section(args.output, section, heading=HEADING)
    return 0
