"""The Markdown section of `make bench` and its place in BENCHMARKS.md."""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

HEADING = "## Chat acceptance latency (make bench)"


def ms(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds >= 10:
        return f"{seconds:.1f} s"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1000:.1f} ms" if seconds < 0.1 else f"{seconds * 1000:.0f} ms"


def secs(seconds: float | None) -> str:
    return "–" if seconds is None else (f"{seconds:.1f} s" if seconds >= 1 else ms(seconds))


def ratio(a: float | None, b: float | None) -> str:
    if not a or not b:
        return "–"
    r = a / b
    return f"{r:.3f}" if r < 0.1 else (f"{r:.2f}" if r < 10 else f"{r:.0f}")


def _rank(n: int, q: float) -> int:
    return max(1, math.ceil(q / 100 * n))


def _row(label: str, answers: str, s: dict) -> str:
    return (f"| {label} | {answers} | {s['ok']} / {s['errors']} | {ms(s['p50'])} | {ms(s['p99'])} | {ms(s['max'])} "
            f"| {secs(s['wall'])} |")


def _calls(llm: dict) -> str:
    by_task = llm.get("by_task") or {}
    chat = {k: v for k, v in by_task.items() if k != "embeddings"}
    total = sum(v["total"] for v in chat.values())
    parts = ", ".join(f"{v['total']} {k}" for k, v in sorted(chat.items()))
    return f"{total} ({parts})" if len(chat) > 1 else str(total)


def _chat_calls(llm: dict) -> int:
    return sum(v["total"] for k, v in (llm.get("by_task") or {}).items() if k != "embeddings")


def render(r: dict) -> str:
    p, m = r["params"], r["machine"]
    n, delay = p["requests"], p["delay"]
    fl, sy, rl = r["floor"], r["sync"], r["ragline"]
    e2e, ver = r.get("e2e"), r.get("verify")
    lines = [HEADING, ""]
    lines.append(
        f"Measured {m['date']} on {m['nproc']} CPUs ({m['cpu'] or 'unknown CPU'}), {m['mem_gb']} GB RAM, {m['os']}; "
        f"Python {m['python']}, temporalio {m['temporalio']}, Temporal CLI {m['temporal_cli'] or '?'} "
        f"(`temporal server start-dev`, SQLite in a temp folder, WAL), uvicorn {m['uvicorn']}, "
        f"FastAPI {m['fastapi']}, openai {m['openai']}; commit `{m['commit'] or '?'}`"
        + (f" with uncommitted changes to {', '.join(f'`{x}`' for x in m['dirty'])}" if m.get("dirty") else "")
        + ". "
        f"Command: `python -m bench --requests {n} --delay {delay:g}` (`make bench` = 200 and 5). "
        f"Every process on this machine over loopback; one client process sends all requests (httpx, "
        f"{n} connections); the whole run took {secs(r.get('bench_seconds'))}.")
    lines.append("")
    lines.append(
        f"**{n} concurrent requests at once; the scripted model (`devtools/scripted_llm.py --delay {delay:g}`) "
        f"answers every chat completion after {delay:g} s.** Latency is per request, from sending it to its "
        f"full response, errors included at the moment they came back; percentiles are nearest-rank "
        f"(p99 of {n} is the {_rank(n, 99)}th).")
    lines.append("")
    lines.append(f"| target | answers with | ok / errors | p50 | p99 | max | wall time, all {n} |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- |")
    lines.append(_row("Ragline `POST /v1/chats` (uvicorn, 1 worker process; distinct sessions)",
                      "202 + job id, before any model call", rl))
    lines.append(_row("plain sync FastAPI `def` endpoint, `bench/sync_app.py` (uvicorn, 1 worker process, "
                      "40 threads)", f"200 + the answer, after its {delay:g} s model call", sy))
    lines.append(_row("floor: bare `client.start_workflow(\"BenchNoop\")` from Python, same Temporal server",
                      "workflow started (task queue nobody polls)", fl))
    lines.append("")
    lines.append(f"Ratios of p50: **Ragline / sync = {ratio(rl['p50'], sy['p50'])}**, "
                 f"**Ragline / floor = {ratio(rl['p50'], fl['p50'])}** "
                 f"(p99: {ratio(rl['p99'], sy['p99'])} and {ratio(rl['p99'], fl['p99'])}).")
    lines.append("")

    lines.append(f"**Until every answer exists.** The sync app's HTTP response carries the answer, so its "
                 f"end to end is its wall time above. A Ragline turn is done when its job completes "
                 f"(`GET /v1/jobs?kind=chat` polled every {p['poll_interval']:g} s; each job's time is its "
                 f"workflow's close time minus its POST); counted are all turns Ragline recorded.")
    lines.append("")
    lines.append("| target | all answered after | per request p50 | p99 | answers/s | model calls | "
                 "max concurrent model calls |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- |")
    slu, rlu = r["sync_llm"], r["ragline_llm"]
    if e2e:
        done_after = e2e["all_done_after"]
        last = e2e["last_done_after"]
        label = secs(done_after) if done_after is not None else \
            f"not all within {p['e2e_timeout']:.0f} s ({e2e['done']}/{e2e['recorded']} done)"
        rate = f"{e2e['done'] / last:.2f}" if last else "–"
        lines.append(f"| Ragline: {e2e['recorded']} chat jobs completed | {label} | {secs(e2e['p50'])} | "
                     f"{secs(e2e['p99'])} | {rate} | {_calls(rlu)} | {rlu.get('max_concurrency')} |")
    else:
        lines.append("| Ragline: chat jobs completed | not measured (`--e2e-timeout 0`) | – | – | – | – | – |")
    sync_rate = f"{sy['ok'] / sy['wall']:.2f}" if sy["wall"] else "–"
    lines.append(f"| plain sync FastAPI app: {sy['ok']} HTTP answers | {secs(sy['wall'])} | {secs(sy['p50'])} | "
                 f"{secs(sy['p99'])} | {sync_rate} | {_calls(slu)} | {slu.get('max_concurrency')} |")
    lines.append("")

    notes = []
    notes.append(f"With a {delay:g} s model the sync app answers each HTTP request only after its model call: "
                 f"40 threadpool threads serve {n} requests in ⌈{n}/40⌉ = {-(-n // 40)} wave(s) of {delay:g} s. "
                 f"Ragline answers `202` once the session workflow has numbered the turn and started its job, "
                 f"before any model call, so its acceptance latency does not depend on the model; it depends on "
                 f"Temporal and on the worker, which must run each session's `submit` update before the API "
                 f"can answer. (`bench/sync_app.py` declares no return type on purpose: with one, FastAPI "
                 f"validates each response in the same thread pool, behind every request still waiting for a "
                 f"thread, and no answer leaves before the last model call ends.)")
    for name, s in (("Ragline", rl), ("sync app", sy), ("floor", fl)):
        if s["errors"]:
            kinds = ", ".join(f"{k} × {v}" for k, v in s["error_kinds"].items())
            notes.append(f"**{name} errors: {kinds}**, answered after {ms(s['error_first'])} … "
                         f"{ms(s['error_last'])}; the {s['ok']} successful requests alone: p50 {ms(s['ok_p50'])}, "
                         f"p99 {ms(s['ok_p99'])}, max {ms(s['ok_max'])}.")
    limit = r.get("api_deadline")
    late = [x for x in (rl.get("ok_latencies") or []) if limit and x > limit + 0.5]
    if late:
        notes.append(f"**{len(late)} Ragline requests got their `202` after more than the API's own {limit:g} s "
                     f"limit** (`RAGLINE_TEMPORAL_RPC_TIMEOUT`, after which `POST /v1/chats` should answer 503): "
                     f"up to {ms(max(late))}.")
    if e2e and e2e["recorded_despite_error"]:
        notes.append(f"**{e2e['recorded_despite_error']} of the {rl['errors']} Ragline requests that got an error "
                     f"were recorded anyway**: their turn jobs (`chat-<session>-1`) exist and ran to the end "
                     f"(they are in the end-to-end numbers and the model-call count). A client that resends "
                     f"after such an error without an `Idempotency-Key` (the bench sends none) gets a second turn.")
    cpu = r.get("cpu_seconds") or {}
    if cpu.get("ragline"):
        def used(phase: str) -> str:
            return ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.get(phase, {}).items(), key=lambda kv: -kv[1])
                             if v >= 0.05) or "none"

        cores = m["nproc"] or 1
        parts = [f"Ragline burst ({secs(rl['wall'])} × {cores} CPUs = {rl['wall'] * cores:.0f} CPU-s): "
                 f"{used('ragline')}", f"floor burst ({secs(fl['wall'])}): {used('floor')}",
                 f"sync burst ({secs(sy['wall'])}): {used('sync')}"]
        busy_others = [ph for ph, b in (("ragline", rl), ("floor", fl), ("sync", sy))
                       if cpu.get(ph, {}).get("other processes", 0) > 0.1 * b["wall"] * cores]
        notes.append("CPU seconds used, by process: " + "; ".join(parts) + "."
                     + (f" **The machine was not idle** during the {', '.join(busy_others)} burst(s): "
                        f"`other processes` are not the bench's." if busy_others else ""))
    if e2e and delay > 0:
        calls = _chat_calls(rlu)
        conc = rlu.get("max_concurrency") or 0
        if calls and conc:
            slots = r.get("worker_io_slots")
            least = (f"{calls} calls × {delay:g} s / {conc} = {calls * delay / conc:.0f} s is the least time for "
                     f"them at that concurrency (measured {secs(e2e['last_done_after'])})")
            if slots and conc >= slots:
                notes.append(f"Ragline's end to end is capped by the worker's activity slots "
                             f"(`RAGLINE_WORKER_IO_CONCURRENCY` = {slots}): {conc} model calls were in flight at "
                             f"most, so {least}.")
            else:
                notes.append(f"At most {conc} Ragline model calls were in flight at once"
                             + (f" (the worker has {slots} activity slots for them)" if slots else "")
                             + f"; {least}.")
            notes[-1] += f" The sync app had {slu.get('max_concurrency')} calls in flight (its thread pool)."
        order = r.get("ragline_call_order") or {}
        if order.get("answers") and order["answers_before_last_prep"] <= order["answers"] // 4:
            notes.append(
                f"Most turns finish late (first after {secs(e2e['first_done_after'])}, p50 {secs(e2e['p50'])}): "
                f"activity tasks are handed out roughly first come first served, so the summarize and "
                f"extract_entities calls of nearly every turn run before the answers "
                f"({order['answers_before_last_prep']} of {order['answers']} answer calls started before the "
                f"last of them, {secs(order['last_prep_started_after'])} in).")
    if ver:
        notes.append(f"Checked every recorded Ragline job with `GET /v1/jobs/{{id}}`: {ver['completed']}/"
                     f"{ver['checked']} completed, {ver['model_answers']} with an answer from the model (retrieval "
                     f"found the ingested passage), {ver['no_context_answers']} \"I don't know\" answers, "
                     f"{ver['retried_steps']} retried steps"
                     + (f"; problems: {'; '.join(ver['errors'])}" if ver["errors"] else "") + ".")
    lines += [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str, heading: str = HEADING) -> None:
    """Create `path`, or replace the section under `heading` (up to the next `## ` heading) and keep the rest."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == heading), None)
    if start is None:
        new = text.rstrip("\n") + "\n\n" + section
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        tail = "".join(lines[end:])
        new = "".join(lines[:start]) + section + ("\n" + tail if tail else "")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".benchmarks-", suffix=".md")
    with os.fdopen(fd, "w") as f:
        f.write(new)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
