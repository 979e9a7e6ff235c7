"""How long a follow-up waits on the local model when it comes while the turn before still runs its summary and
entities: `python -m bench.follow_up_wait`.

A person reads an answer for a few seconds, then asks the next question. On `make run`'s local model (one
model slot) the turn before is then often still summarizing, and a summary of a real document's passages takes
tens of seconds on two cores. Each round here: a question about a real PDF in a fresh session; `--read` seconds
after its answer is complete, a follow-up in the same session; the follow-up's first answer delta, and when the
turn before ended. Run it from two checkouts to compare code; the stack is `python -m bench`'s (dev server,
worker, API), with llama.cpp as `python -m bench --phases local` starts it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench import procs
from bench.procs import ROOT
from bench.run import LocalModelSkipped, Stack, local_model, log, wait_job
from bench.sse import TurnTimes, chat_turn, watch

PDF = ROOT.parent / "shared" / "pdfs" / "Seige_of_Vicksburg_Sample_OCR.pdf"
COLLECTION = "follow-up-wait"
QUESTIONS = (("What happened during the siege of Vicksburg?", "Who commanded the Union army there?"),
             ("How did the people of Vicksburg live during the siege?", "What did they eat?"),
             ("When did Vicksburg surrender?", "What happened after the surrender?"),
             ("What was the role of the Confederate army at Vicksburg?", "Who led it?"))


async def upload(http, pdf: Path) -> None:  # noqa: ANN001
    r = await http.post("/v1/documents", data={"collection": COLLECTION},
                        files=[("files", (pdf.name, pdf.read_bytes(), "application/pdf"))])
    if r.status_code != 202:
        raise RuntimeError(f"upload refused: {r.status_code} {r.text[:300]}")
    job = await wait_job(http, r.json()["job_id"], 600)
    if job["status"] != "completed":
        raise RuntimeError(f"ingestion failed: {job.get('error')}")


async def one_round(http, question: str, follow_up: str, read: float) -> dict:  # noqa: ANN001
    """A question, and `read` s after its answer a follow-up in its session: seconds from each POST."""
    session = f"wait-{uuid.uuid4().hex[:6]}"
    first = TurnTimes(session_id=session)
    t0 = time.perf_counter()
    r = await http.post("/v1/chats", json={"message": question, "collection": COLLECTION, "session_id": session})
    if r.status_code != 202:
        raise RuntimeError(f"chat refused: {r.status_code} {r.text[:300]}")
    first.job_id = r.json()["job_id"]
    watching = asyncio.create_task(watch(http, first.job_id, t0, first))
    while first.answer_completed is None and not watching.done():
        await asyncio.sleep(0.02)
    await asyncio.sleep(read)
    asked = time.perf_counter() - t0
    later = await chat_turn(http, {"message": follow_up, "collection": COLLECTION, "session_id": session}, 600)
    await watching
    before = (await http.get(f"/v1/jobs/{first.job_id}")).json()
    return {"answer": first.answer_completed, "asked": asked, "before_ended": first.terminal,
            "before_status": before["status"], "first_delta": later.first_delta, "done": later.terminal,
            "completed": later.completed and first.completed,
            "set_aside": [s["name"] for s in before.get("steps", []) if "stopped for" in (s.get("detail") or "")]}


async def main(args: argparse.Namespace) -> int:
    if not args.pdf.is_file():
        log(f"skipped: no {args.pdf} (the shared PDFs: ../shared/pdfs)")
        return 0
    stack = Stack(Path(tempfile.mkdtemp(prefix="ragline-follow-up-wait-")))
    rows = []
    try:
        await stack.start(0)
        async with local_model(stack, args.local_model, args.local_model_threads):
            async with procs.client(stack.api_url, 600) as http:
                await upload(http, args.pdf)
                await chat_turn(http, {"message": "What is Vicksburg?", "collection": COLLECTION,
                                       "session_id": f"warm-{uuid.uuid4().hex[:6]}"}, 600)  # warm-up
                for i in range(args.rounds):
                    question, follow_up = QUESTIONS[i % len(QUESTIONS)]
                    row = await one_round(http, question, follow_up, args.read)
                    log(f"round {i + 1}: {row}")
                    rows.append(row)
    except LocalModelSkipped as skipped:
        log(f"skipped: {skipped}")
        return 0
    finally:
        await stack.stop()
    print(f"\n{args.rounds} rounds, follow-up sent {args.read:g} s after the answer before it "
          f"({args.pdf.name}, collection {COLLECTION!r}); seconds from each turn's POST\n")
    print("| round | turn before: answer complete | follow-up sent | turn before ended | follow-up's first delta | "
          "steps of the turn before run again after it | both completed |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for i, r in enumerate(rows, 1):
        delta = f"{r['first_delta']:.1f}" if r["first_delta"] is not None else "none"
        print(f"| {i} | {r['answer']:.1f} | {r['asked']:.1f} | {r['before_ended']:.1f} | {delta} | "
              f"{', '.join(r['set_aside']) or '–'} | {'yes' if r['completed'] else 'no'} |")
    deltas = [r["first_delta"] for r in rows if r["first_delta"] is not None]
    if deltas:
        print(f"\nfollow-up's first delta: median {statistics.median(deltas):.1f} s, max {max(deltas):.1f} s")
    return 0 if all(r["completed"] for r in rows) else 1


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.follow_up_wait", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--read", type=float, default=3.0, help="seconds between an answer and the follow-up (3)")
    p.add_argument("--pdf", type=Path, default=PDF)
    p.add_argument("--local-model", default=None, help="the local model's key (RAGLINE_LOCAL_MODEL's default)")
    p.add_argument("--local-model-threads", type=int, default=None)
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse(sys.argv[1:]))))
