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


def _g(x: float | None) -> str:
    return "?" if x is None else f"{x:g}"


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
    lines.append(_row("Ragline `POST /v1/chats` (uvicorn, 1 worker process; distinct sessions, no "
                      "`Idempotency-Key`)", "202 + job id, before any model call", rl))
    raw = r.get("ragline_raw")
    raw_fl = r.get("floor_raw") or fl
    rounds = r.get("raw_rounds") or []
    pooled = f"; {len(rounds)} bursts pooled, each right after a floor burst of its own" if len(rounds) > 1 else ""
    if raw:
        lines.append(_row("the same, sent by the light client (`bench/rawhttp.py`: prebuilt requests on connections "
                          f"opened beforehand; its turns terminated, not run{pooled})", "202 + job id", raw))
    threads = r.get("sync_threads")
    lines.append(_row("plain sync FastAPI `def` endpoint, `bench/sync_app.py` (uvicorn, 1 worker process, "
                      f"{threads or '?'} threads)", f"200 + the answer, after its {delay:g} s model call", sy))
    lines.append(_row("floor: bare `client.start_workflow(\"BenchNoop\")` from Python, same Temporal server",
                      "workflow started (task queue nobody polls)", fl))
    if r.get("floor_raw"):
        lines.append(_row(f"the floor again, right before each light-client burst{pooled}",
                          "workflow started", raw_fl))
    lines.append("")
    lines.append(f"Ratios of p50: **Ragline / sync = {ratio(rl['p50'], sy['p50'])}**, "
                 f"**Ragline / floor = {ratio(rl['p50'], fl['p50'])}** "
                 f"(p99: {ratio(rl['p99'], sy['p99'])} and {ratio(rl['p99'], fl['p99'])})"
                 + (f"; with the light client Ragline / floor = **{ratio(raw['p50'], raw_fl['p50'])}** "
                    f"(p99 {ratio(raw['p99'], raw_fl['p99'])})" if raw else "") + "."
                 + (" Light client round by round, p50 Ragline / floor: " + ", ".join(
                     f"{ms(x['p50'])} / {ms(x['floor_p50'])} = {ratio(x['p50'], x['floor_p50'])}" for x in rounds) + "."
                    if len(rounds) > 1 else ""))
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
    st = r.get("settings") or {}
    waves = f"⌈{n}/{threads}⌉ = {-(-n // threads)} wave(s)" if threads else "waves"
    notes.append(f"With a {delay:g} s model the sync app answers each HTTP request only after its model call: "
                 f"{threads or '?'} threadpool threads (anyio's limiter, as the app reports it) serve {n} requests "
                 f"in {waves} of {delay:g} s. "
                 f"Ragline answers `202` after one signal-with-start of the session workflow (the turn's job id "
                 f"is derived from the session and a key; no worker in the path), bounded by "
                 f"`{st.get('rpc_timeout_name', '?')}` = {_g(st.get('rpc_timeout'))} s; the session numbers the "
                 f"turn and starts its job later. So its acceptance latency does not depend on the model; it "
                 f"depends on the API process and on the Temporal server, which the worker's background work "
                 f"(the turns already accepted) shares the 2 CPUs with. (`bench/sync_app.py` declares no return "
                 f"type on purpose: with one, FastAPI "
                 f"validates each response in the same thread pool, behind every request still waiting for a "
                 f"thread, and no answer leaves before the last model call ends.)")
    for name, s in (("Ragline", rl), ("sync app", sy), ("floor", fl)):
        if s["errors"]:
            kinds = ", ".join(f"{k} × {v}" for k, v in s["error_kinds"].items())
            notes.append(f"**{name} errors: {kinds}**, answered after {ms(s['error_first'])} … "
                         f"{ms(s['error_last'])}; the {s['ok']} successful requests alone: p50 {ms(s['ok_p50'])}, "
                         f"p99 {ms(s['ok_p99'])}, max {ms(s['ok_max'])}.")
    limit = st.get("rpc_timeout")
    late = [x for x in (rl.get("ok_latencies") or []) if limit and x > limit + 0.5]
    if late:
        notes.append(f"**{len(late)} Ragline requests got their `202` after more than the API's own {limit:g} s "
                     f"limit** (`{st['rpc_timeout_name']}`, the settings the API ran with; after it "
                     f"`POST /v1/chats` should answer 503): up to {ms(max(late))}.")
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
        if raw and cpu.get("ragline_raw"):
            per = " per burst, mean of the rounds" if len(rounds) > 1 else ""
            parts.insert(1, f"Ragline burst, light client ({secs(raw['wall'])}{per}): {used('ragline_raw')}")
        busy_others = [ph for ph, b in (("ragline", rl), ("floor", fl), ("sync", sy))
                       if cpu.get(ph, {}).get("other processes", 0) > 0.1 * b["wall"] * cores]
        notes.append("CPU seconds used, by process: " + "; ".join(parts) + "."
                     + (f" **The machine was not idle** during the {', '.join(busy_others)} burst(s): "
                        f"`other processes` are not the bench's." if busy_others else ""))
    if e2e and delay > 0:
        calls = _chat_calls(rlu)
        conc = rlu.get("max_concurrency") or 0
        if calls and conc:
            slots = st.get("llm_slots")
            least = (f"{calls} calls × {delay:g} s / {conc} = {calls * delay / conc:.0f} s is the least time for "
                     f"them at that concurrency (measured {secs(e2e['last_done_after'])})")
            if slots and conc >= slots:
                notes.append(f"Ragline's end to end is capped by the worker's slots for model calls "
                             f"({st['llm_slots_text']}): {conc} model calls were in flight at most, so {least}.")
            else:
                notes.append(f"At most {conc} Ragline model calls were in flight at once"
                             + (f" (the worker has {slots} slots for them: {st['llm_slots_text']})" if slots else "")
                             + f"; {least}.")
            notes[-1] += f" The sync app had {slu.get('max_concurrency')} calls in flight (its thread pool)."
        order = r.get("ragline_call_order") or {}
        if order.get("answers"):
            notes.append(f"Model calls are handed out first come first served: the {order['answers']} answer calls "
                         f"started {secs(order['answers_from'])} … {secs(order['answers_to'])} after the first "
                         f"model call (half of them by {secs(order.get('answers_half'))}, when "
                         f"{order.get('side_before_half', '?')} side-step calls had started), the {order['side']} "
                         f"side-step calls (summarize, extract_entities) {secs(order['side_from'])} … "
                         f"{secs(order['side_to'])}; first turn done after {secs(e2e['first_done_after'])}, p50 "
                         f"{secs(e2e['p50'])}.")
    if ver:
        notes.append(f"Checked every recorded Ragline job with `GET /v1/jobs/{{id}}`: {ver['completed']}/"
                     f"{ver['checked']} completed, {ver['model_answers']} with an answer from the model (retrieval "
                     f"found the ingested passage), {ver['no_context_answers']} \"I don't know\" answers, "
                     f"{ver['retried_steps']} retried steps"
                     + (f"; problems: {'; '.join(ver['errors'])}" if ver["errors"] else "") + ".")
    lines += [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str, heading: str = HEADING, after: str | None = None) -> None:
    """Create `path`, or replace the section under `heading` (up to the next `## ` heading) and keep the rest.
    A new section goes right after the section under `after` if there is one, else at the end."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = text.splitlines(keepends=True)

    def find(h: str) -> tuple[int, int] | None:
        start = next((i for i, line in enumerate(lines) if line.rstrip() == h), None)
        if start is None:
            return None
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        return start, end

    here = find(heading)
    if here is None and after is not None and find(after) is not None:
        end = find(after)[1]
        here = (end, end)
    if here is None:
        new = text.rstrip("\n") + "\n\n" + section
    else:
        start, end = here
        head = "".join(lines[:start])
        if head and not head.endswith("\n\n"):
            head = head.rstrip("\n") + "\n\n"
        tail = "".join(lines[end:])
        new = head + section + ("\n" + tail if tail else "")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".benchmarks-", suffix=".md")
    with os.fdopen(fd, "w") as f:
        f.write(new)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------
# Ragline against its floors (issue 9): bench/ratios.py

RATIOS_HEADING = "## Ragline against its floors (make bench)"
# The targets of issue 9, as ratios to a floor measured in the same run.
TARGETS = {"accept_p50": 1.2, "accept_p99": 1.5, "first_delta": 1.3, "overhead": 3.0}


def _r(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _against(value: float | None, target: float) -> str:
    if value is None:
        return "–"
    return f"{ratio(value, 1.0)} ({'met' if value <= target else '**missed**'})"


def _bold_if(text: str, cond: bool) -> str:
    return f"**{text}**" if cond else text


def render_ratios(r: dict) -> str:
    p, m, st = r["params"], r["machine"], r.get("settings") or {}
    rt = r.get("ratios") or {}
    delay = p["delay"]
    lines = [RATIOS_HEADING, ""]
    argv = " ".join(p.get("argv") or [])
    lines.append(
        f"Measured {m['date']} on {m['nproc']} CPUs, in the same run and on the same stack as the sections "
        f"around it (commit `{m['commit'] or '?'}`); command `python -m bench{(' ' + argv) if argv else ''}`"
        f"{'' if argv else ' (`make bench`)'}. Each ratio divides Ragline's number by a floor measured minutes "
        f"apart on the same machine; targets are issue 9's. Percentiles are nearest-rank. "
        f"Settings in force, read from `ragline.settings.Settings` built with the environment the API and the "
        f"worker were started with (\"default\": the bench leaves it unset): {'; '.join(st.get('lines') or [])}; "
        f"model calls in flight: {st.get('llm_slots_text', '?')}."
        + (f" The bench's API key (tenant `{key['tenant']}`, role {key['role']}) has its own "
           f"`requests_per_minute` = {key['requests_per_minute']:,} in the keys file, so the per-key rate limit "
           f"is in the path but never reached"
           + (f"; its tenant may run {key['max_running_jobs']:,} jobs at once (`[tenants.{key['tenant']}] "
              f"max_running_jobs`), so every turn takes a running slot from the tenant's gate but none waits for one"
              if key.get("max_running_jobs") else "") + "." if (key := r.get("api_key")) else ""))
    lines.append("")

    # -- acceptance -----------------------------------------------------------------------------
    lines.append(f"**Acceptance** (scripted model answering after {delay:g} s; Ragline: `POST /v1/chats` → `202`, "
                 f"no `Idempotency-Key`; floor: bare `client.start_workflow` of a no-op workflow type on a task "
                 f"queue nobody polls, same server, same concurrency; sync app: the answer, after its model call).")
    lines.append("")
    lines.append(f"| workload | Ragline p50 / p99 | floor p50 / p99 | sync app p50 / p99 | Ragline / floor p50 "
                 f"(≤ {TARGETS['accept_p50']:g}) | Ragline / floor p99 (≤ {TARGETS['accept_p99']:g}) | "
                 f"Ragline / sync p50 / p99 | Ragline 5xx | turns numbered in send order |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    accept_rows = []
    if r.get("ragline"):
        rl, fl, sy = r["ragline"], r["floor"], r["sync"]
        n5 = sum(v for k, v in (rl.get("error_kinds") or {}).items() if k.startswith("HTTP 5"))
        accept_rows.append((f"{rl['n']} at once, {rl['n']} sessions", rl, fl, sy, n5,
                            "– (one turn per session)"))
        if r.get("ragline_raw"):
            rw = r["ragline_raw"]
            n5 = sum(v for k, v in (rw.get("error_kinds") or {}).items() if k.startswith("HTTP 5"))
            rounds = r.get("raw_rounds") or []
            label = (f"{rw['n'] // len(rounds)} at once, as many sessions, light client ({len(rounds)} bursts "
                     f"pooled, each against a floor burst just before it)" if len(rounds) > 1
                     else f"{rw['n']} at once, {rw['n']} sessions, light client")
            accept_rows.append((label, rw, r.get("floor_raw") or fl, sy, n5, "– (one turn per session)"))
    else:
        lines.append(f"| {p['requests']} at once, {p['requests']} sessions | not run (`accept` not in --phases) "
                     f"| | | | | | | |")
    order = rt.get("order")
    if order:
        o = order["order"]
        kept = (f"{o['in_order']}/{o['sessions']} sessions ({o['contiguous']} numbered exactly 1…"
                f"{order['per_session']}); {o['numbered']}/{order['requests']} turns numbered")
        accept_rows.append((f"{order['requests']} over {order['sessions']} sessions, each session's "
                            f"{order['per_session']} one after another", order["ragline"], order["floor"],
                            order["sync"], order["http_5xx"], _bold_if(kept, o["in_order"] < o["sessions"])))
    elif "order" not in (p.get("phases") or []):
        lines.append(f"| {p['seq_requests']} over {p['seq_sessions']} sessions in order | not run | | | | | | | |")
    for label, rl, fl, sy, n5, kept in accept_rows:
        lines.append(
            f"| {label} | {ms(rl['p50'])} / {ms(rl['p99'])} | {ms(fl['p50'])} / {ms(fl['p99'])} | "
            f"{ms(sy['p50'])} / {ms(sy['p99'])} | {_against(_r(rl['p50'], fl['p50']), TARGETS['accept_p50'])} | "
            f"{_against(_r(rl['p99'], fl['p99']), TARGETS['accept_p99'])} | "
            f"{ratio(rl['p50'], sy['p50'])} / {ratio(rl['p99'], sy['p99'])} | {_bold_if(str(n5), n5 > 0)} | {kept} |")
    lines.append("")

    # -- first answer delta -----------------------------------------------------------------------
    lines.append("**Time to the first answer delta** (sequential turns, each in a fresh session; Ragline: from "
                 "sending `POST /v1/chats` to reading the first `ragline.answer.delta` on "
                 "`GET /v1/jobs/{id}/events`; floor: one bare streamed chat completion with the `openai` client, "
                 "the same messages the turn's answer step sent, the same model server and parameters, to its "
                 "first content piece; turn and bare call alternate which goes first).")
    lines.append("")
    lines.append(f"| model | turns | Ragline first delta p50 / max | bare call TTFT p50 / max | Ragline / bare p50 "
                 f"(≤ {TARGETS['first_delta']:g}) | difference p50 | turn done (p50) | turns completed |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    ttfd = rt.get("ttfd")
    if ttfd:
        lines.append(_ttfd_row(f"scripted (`devtools/scripted_llm.py`: reply after {p['ttfd_delay']:g} s, "
                               f"{p['ttfd_chunk_delay']:g} s between pieces)", ttfd))
    else:
        lines.append("| scripted | not run (`ttfd` not in --phases) | | | | | | |")
    follow = rt.get("follow_up")
    if follow:
        lines.append(_ttfd_row(f"scripted, a follow-up in the same session, sent the moment the turn before it "
                               f"has its answer (that turn's summary and entities still to come, "
                               f"{ms(follow['first_ended_after_answer']['p50'])} more at p50)", follow))
    local = rt.get("local")
    if local and local.get("skipped"):
        lines.append(f"| local `{local['model']}` | **skipped: {local['skipped']}** | | | | | | |")
    elif local:
        ws = local.get("worker_settings") or {}
        lines.append(_ttfd_row(f"local `{local['model']}` (llama.cpp through llama-cpp-python, worker with "
                               f"{ws.get('llm_slots_text', '?')})", local))
        if local.get("follow_up"):
            follow = local["follow_up"]
            lines.append(_ttfd_row(f"local, a follow-up sent the moment the turn before it has its answer (that "
                                   f"turn ended {secs(follow['first_ended_after_answer']['p50'])} after its answer, "
                                   f"p50; the bare call sends the first turn's prompt)", follow))
    else:
        lines.append("| local | not run (`local` not in --phases) | | | | | | |")
    lines.append("")

    # -- burst ----------------------------------------------------------------------------------------
    b = rt.get("burst")
    # Runs before the rounds existed compared their one burst with the acceptance phase's sync burst.
    rounds = (b or {}).get("rounds") or ([{**b, "sync": r.get("sync") or {}}] if b else [])
    paired = len(rounds) > 1 or bool((b or {}).get("rounds"))
    lines.append(f"**A burst of chats** ({p['burst_chats']} at once, distinct sessions, scripted model answering "
                 f"after {delay:g} s; each client POSTs, then reads its job's events to the end; "
                 + (f"{len(rounds)} rounds, each a burst of as many requests to the sync app right before Ragline's, "
                    f"so each Ragline burst is held against the sync burst next to it; the verdict is the median "
                    f"round's)." if paired else
                    "the sync app's numbers are those of the acceptance burst above, same model delay, same run)."))
    lines.append("")
    lines.append("| target | completed | POST → 202 p50 | POST → first delta p50 / p99 | sync app response p50 "
                 "| first delta / sync p50 | POST → `ragline.job.completed` p50 / max |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- |")
    for k, rb in enumerate(rounds, 1):
        fd, sy50 = rb["first_delta"], rb["sync"].get("p50")
        rr = _r(fd["p50"], sy50)
        verdict = "–" if rr is None else f"{ratio(fd['p50'], sy50)} ({'below' if rr < 1 else '**not below**'})"
        done = f"{rb['completed']}/{rb['n']}"
        label = f"Ragline, {rb['n']} chats" + (f", round {k}" if paired else "")
        lines.append(f"| {label} | {_bold_if(done, rb['completed'] < rb['n'])} | {ms(rb['accept']['p50'])} "
                     f"| {secs(fd['p50'])} / {secs(fd['p99'])} | {secs(sy50)} | {verdict} | "
                     f"{secs(rb['terminal']['p50'])} / {secs(rb['terminal']['max'])} |")
    if not rounds:
        lines.append("| Ragline | not run (`burst` not in --phases) | | | | | |")
    lines.append("")
    if len(rounds) > 1:
        fd, sy50 = b["first_delta"]["p50"], b["sync"]["p50"]
        rr = _r(fd, sy50)
        lines.append(f"Median round ({b['round']}): first delta p50 {secs(fd)} against the sync app's {secs(sy50)}, "
                     f"{ratio(fd, sy50)}: **{'below' if rr is not None and rr < 1 else 'not below'}**. The segments "
                     f"and model-call notes below are that round's.")
        lines.append("")

    # -- orchestration cost -----------------------------------------------------------------------
    o = rt.get("overhead")
    lines.append("**The orchestration's own cost** (scripted model answering at once, no pause between pieces; "
                 "sequential, alternating; Ragline: a turn in a fresh session from sending `POST /v1/chats` to "
                 "reading `ragline.job.completed` on its event stream; floor: `client.execute_workflow` of a bare "
                 "workflow that runs one activity, `bench/floor_worker.py`, its own worker process and task queue, "
                 "same server, start to result).")
    lines.append("")
    if o:
        rr = _r(o["ragline"]["p50"], o["bare"]["p50"])
        lines.append(f"| measured | n | p50 | p90 | max | ratio p50 (≤ {TARGETS['overhead']:g}) |")
        lines.append("| --- | --- | --- | --- | --- | --- |")
        lines.append(f"| Ragline chat turn, POST → `ragline.job.completed` | {o['ragline']['n']} | "
                     f"{ms(o['ragline']['p50'])} | {ms(o['ragline']['p90'])} | {ms(o['ragline']['max'])} | "
                     f"{_against(rr, TARGETS['overhead'])} |")
        lines.append(f"| bare workflow, one activity, start → result | {o['bare']['n']} | {ms(o['bare']['p50'])} | "
                     f"{ms(o['bare']['p90'])} | {ms(o['bare']['max'])} | 1 |")
        lines.append("")
        lines.extend(_overhead_extra(o))
    else:
        lines.append("Not run (`overhead` not in --phases).")
        lines.append("")
    lines.extend(_breakdown(rt, p))

    notes = _ratio_notes(r)
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines).rstrip("\n") + "\n"


def _ttfd_row(label: str, t: dict) -> str:
    rl, bare = t["ragline"], t["bare"]
    rr = _r(rl["p50"], bare["p50"])
    diff = (rl["p50"] - bare["p50"]) if rl["p50"] is not None and bare["p50"] is not None else None
    done = f"{t['completed']}/{t['turns']}"
    return (f"| {label} | {t['turns']} | {ms(rl['p50'])} / {ms(rl['max'])} | {ms(bare['p50'])} / {ms(bare['max'])} | "
            f"{_against(rr, TARGETS['first_delta'])} | {ms(diff)} | {secs(t['turn_total']['p50'])} | "
            f"{_bold_if(done, t['completed'] < t['turns'])} |")


def _seg(stats: dict | None, key: str = "p50") -> str:
    return ms((stats or {}).get(key))


def _breakdown(rt: dict, p: dict) -> list[str]:
    """Where a turn's time goes, per phase: the segments of bench/timeline.py, p50 over the phase's turns."""
    from bench.timeline import TURN_SEGMENTS

    o, t, b = rt.get("overhead"), rt.get("ttfd"), rt.get("burst")
    cols = [(f"0 s model, {o['ragline']['n']} turns one at a time (to `ragline.job.completed`)", o, "turn_segments")
            if o else None,
            (f"first delta, scripted model ({p['ttfd_delay']:g} s to its first piece), {t['turns']} turns one at a "
             f"time", t, "segments") if t else None,
            (f"first delta in the burst ({b['n']} at once, {p['delay']:g} s model)", b, "segments") if b else None]
    cols = [c for c in cols if c and c[1].get(c[2])]
    if not cols:
        return []
    lines = ["**Where a turn's time goes** (p50 of each segment over the phase's turns, from the Temporal histories "
             "of the turn's job and its session, server timestamps, one clock; each segment ends at the moment named "
             "and starts where the one before it ended, the first at the POST; the first-delta columns end with "
             "the client reading the first delta, the 0 s column goes on to the end of the job):", "",
             "| segment (ends when …) | " + " | ".join(c[0] for c in cols) + " |",
             "| --- | " + " | ".join("---" for _ in cols) + " |"]
    prefix = [name for name, _ in TURN_SEGMENTS[:8]]
    rows = [(name, what) for name, what in TURN_SEGMENTS[:8]]
    rows.append(("first_delta", "the client reads the first `ragline.answer.delta` (model's first piece, "
                                "published, relayed by the API)"))
    rows += [(name, what) for name, what in TURN_SEGMENTS[8:]]
    for name, what in rows:
        cells = []
        for _, data, key in cols:
            segs = data.get(key) or {}
            if key == "turn_segments":
                cells.append(_seg(segs.get(name)) if name != "first_delta" else "")
            else:
                cells.append(_seg(segs.get(name)) if name in prefix or name == "first_delta" else "")
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    totals = [ms((data.get("first_delta") if data is b else data.get("ragline") or {}).get("p50"))
              for _, data, _ in cols]
    lines.append("| **total, p50 of the whole** (not the sum of the p50s) | " + " | ".join(totals) + " |")
    lines.append("")
    return lines


def _overhead_extra(o: dict) -> list[str]:
    from bench.timeline import BARE_SEGMENTS

    bare = ", ".join(f"{what.split(' (')[0]} {ms((o['bare_segments'].get(name) or {}).get('p50'))}"
                     for name, what in BARE_SEGMENTS)
    h = o.get("history") or {}
    t, s_, bw = h.get("turn") or {}, h.get("session") or {}, h.get("bare") or {}
    lines = [f"The bare workflow's segments (p50): {bare}. History per turn (p50): the turn's job "
             f"{t.get('events')} events, {t.get('workflow_tasks')} workflow tasks, {t.get('signals')} signals "
             f"(batches of answer deltas; `proceed` when the go did not come with the start), {t.get('updates')} "
             f"accepted Updates (event-stream polls), {t.get('activities')} activities; its session "
             f"{s_.get('events')} events, {s_.get('workflow_tasks')} workflow tasks; the bare workflow "
             f"{bw.get('events')} events, {bw.get('workflow_tasks')} workflow tasks."]
    cpu = o.get("cpu") or {}
    n = (o.get("turns") or 0) + (o.get("warm") or 0)
    if cpu and n:
        used = ", ".join(f"{k} {v / n * 1000:.0f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])
                         if v >= 0.05)
        lines.append("")
        lines.append(f"CPU per round (one turn + one bare workflow, {n} rounds incl. warm-up), ms by process: {used}.")
    lines.append("")
    return lines


def _ratio_notes(r: dict) -> list[str]:
    rt, st = r.get("ratios") or {}, r.get("settings") or {}
    notes = []
    order = rt.get("order")
    if order:
        rl = order["ragline"]
        kinds = ", ".join(f"{k} × {v}" for k, v in sorted(order["statuses"].items()))
        notes.append(f"In order: Ragline answered {kinds} (wall {secs(rl['wall'])} for all "
                     f"{order['requests']}); {order['terminated']} workflows of that phase were terminated "
                     f"afterwards (their turns would have kept the model busy for minutes)."
                     + (f" Problems: {'; '.join(order['order']['problems'])}." if order["order"]["problems"] else ""))
        limit = st.get("rpc_timeout")
        late = [x for x in (rl.get("ok_latencies") or []) if limit and x > limit]
        if late:
            notes.append(f"**{len(late)} in-order requests took longer than `{st['rpc_timeout_name']}` = "
                         f"{limit:g} s** and still got their `202`.")
    b = rt.get("burst")
    if b:
        which = f" (round {b['round']}, the median)" if len(b.get("rounds") or []) > 1 else ""
        if b["errors"]:
            notes.append(f"**Burst problems:** {'; '.join(str(e) for e in b['errors'])}.")
        cpu = b.get("cpu") or {}
        if cpu:
            notes.append(f"Burst{which}, CPU seconds by process: " + ", ".join(
                f"{k} {v:.1f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]) if v >= 0.05)
                + f" (over {secs(b['wall'])}).")
        llm, co = b.get("llm") or {}, b.get("call_order") or {}
        if llm.get("max_concurrency"):
            notes.append(f"Burst{which}: at most {llm['max_concurrency']} model calls in flight "
                         f"({st.get('llm_slots_text', '?')}); {b['no_delta']} turns saw no answer delta."
                         + (f" Half of the {co['answers']} answer calls had started {secs(co['answers_half'])} after "
                            f"the first model call, and {co['side_before_half']} of the {co['side']} side-step calls "
                            f"(summarize, extract_entities) had started before that (on the `llm` queue a waiting "
                            f"answer goes before a waiting side step, by priority; a side step of an earlier turn "
                            f"can start while the later answers are not yet scheduled)." if co.get("answers") else ""))
    for key in ("ttfd", "local"):
        t = rt.get(key)
        if t and not t.get("skipped") and t["completed"] < t["turns"]:
            bad = [row["turn"].get("error") or row["turn"].get("terminal_type") for row in t["rows"]
                   if row["turn"].get("terminal_type") != "ragline.job.completed"]
            notes.append(f"**{key}: {t['turns'] - t['completed']} turns did not complete:** {'; '.join(map(str, bad[:3]))}.")
    accept_order = r.get("ragline_call_order") or {}
    burst_order = (b or {}).get("call_order") or {}
    if accept_order.get("answers") and burst_order.get("answers"):
        notes.append(f"The same kind of burst without event streams (the acceptance burst, its turns followed by "
                     f"polling `GET /v1/jobs`): half of its {accept_order['answers']} answer calls had started "
                     f"{secs(accept_order['answers_half'])} after the first model call, after "
                     f"{accept_order['side_before_half']} side-step calls; with one SSE stream per chat "
                     f"{secs(burst_order['answers_half'])}, after {burst_order['side_before_half']}. Every stream "
                     f"reads its job through Updates to the job's workflow (`temporalio.contrib.workflow_streams`), "
                     f"and each Update is a workflow task the worker runs next to the turns' own."
                     + (f" (Processes that are not the bench's used {other_b:.0f} CPU-s during the burst and "
                        f"{other_a:.0f} during the acceptance burst's drain: part of the difference may be theirs.)"
                        if (other_b := ((b or {}).get("cpu") or {}).get("other processes")) is not None
                        and (other_a := ((r.get("cpu_seconds") or {}).get("ragline_drain") or {})
                             .get("other processes")) is not None else ""))
    busy = []
    cores = (r.get("machine") or {}).get("nproc") or 1
    for key in ("burst", "order", "ttfd", "overhead", "local"):
        ph = rt.get(key) or {}
        other, wall = (ph.get("cpu") or {}).get("other processes", 0.0), ph.get("phase_wall")
        if wall and other > 0.1 * wall * cores:
            busy.append(f"`{key}` {other:.0f} of {wall * cores:.0f} CPU-s")
    if busy:
        notes.append(f"**The machine was not idle**: processes that are not the bench's used {', '.join(busy)} "
                     f"({cores} CPUs × the phase's wall time); the ratios compare numbers taken under that load.")
    local = rt.get("local")
    if local and not local.get("skipped"):
        notes.append(f"Local model: llama.cpp started as `{local.get('llama_argv', '?')}`; before each measured "
                     f"turn and bare call a 1-token call with another prompt empties llama.cpp's prompt cache, so "
                     f"neither reuses the other's evaluated prompt.")
    return notes
