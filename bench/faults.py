"""Second measurement of `make bench`: completion under injected model faults.

The same fixed workload runs once per fault rate (0 and --fault-rate): --fault-chats chat turns spread
over 10 sessions against collection "bench" (one ingested document, so every turn calls the model 3
times: summarize, extract_entities, answer) plus --fault-ingests small text documents uploaded one per
request into their own collection. The scripted model answers every chat completion after
--fault-delay s; with faults on, each of its chat completions fails with probability --fault-rate
(429 with Retry-After 1, 503, dropped connection, hang, malformed body, chosen uniformly, seeded). The
worker runs with RAGLINE_LLM_TIMEOUT=3 (a hang costs 3 s) and the shipped temporal/policies.toml.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import datetime

import httpx

from bench import config, report
from bench.measure import percentile
from bench import procs
from bench.procs import ROOT

SESSIONS = 10
KINDS = ["429", "503", "drop", "hang", "malformed"]
LLM_TIMEOUT = 3
SEED = 1
HEADING = "## Completion under injected faults (make bench)"
FAULT_COLLECTION = "bench-faults"


def _doc(tag: str, i: int) -> bytes:
    return (f"Field report {tag}-{i}. The Porto warehouse number {i} ships spare parts for wind turbines. "
            f"Its manager, Ana Costa, counted {100 + i} pallets on the last inventory day; the loading dock "
            f"closes at six in the evening and reopens at seven in the morning.\n").encode()


async def _post_chats(http: httpx.AsyncClient, tag: str, n_chats: int, question: str,
                      collection: str) -> tuple[list[tuple[str, float]], list[str]]:
    """Sessions in parallel; the turns of one session posted in order."""
    jobs: list[tuple[str, float]] = []
    errors: list[str] = []

    async def session(s: int) -> None:
        for t in range(s, n_chats, SESSIONS):
            t_post = time.time()
            try:
                r = await http.post("/v1/chats", json={"message": f"{question} (#{t})", "collection": collection,
                                                       "session_id": f"{tag}-s{s}"})
                if r.status_code == 202:
                    jobs.append((r.json()["job_id"], t_post))
                else:
                    errors.append(f"chat {t}: HTTP {r.status_code} {r.text[:120]}")
            except httpx.HTTPError as exc:
                errors.append(f"chat {t}: {type(exc).__name__}")

    await asyncio.gather(*(session(s) for s in range(min(SESSIONS, n_chats))))
    return jobs, errors


async def _post_ingests(http: httpx.AsyncClient, tag: str, n: int) -> tuple[list[tuple[str, float]], list[str]]:
    jobs: list[tuple[str, float]] = []
    errors: list[str] = []

    async def one(i: int) -> None:
        t_post = time.time()
        try:
            r = await http.post("/v1/documents", data={"collection": FAULT_COLLECTION},
                                files=[("files", (f"report-{tag}-{i}.txt", _doc(tag, i), "text/plain"))])
            if r.status_code == 202:
                jobs.append((r.json()["job_id"], t_post))
            else:
                errors.append(f"ingest {i}: HTTP {r.status_code} {r.text[:120]}")
        except httpx.HTTPError as exc:
            errors.append(f"ingest {i}: {type(exc).__name__}")

    await asyncio.gather(*(one(i) for i in range(n)))
    return jobs, errors


async def _wait_all(http: httpx.AsyncClient, job_ids: list[str], deadline: float, terminal: tuple[str, ...],
                    log) -> dict[str, dict]:  # noqa: ANN001
    """GET /v1/jobs/{id} until every job is terminal or the deadline passes; the last view of each."""
    last: dict[str, dict] = {}
    pending = set(job_ids)
    sem = asyncio.Semaphore(8)
    next_note = time.monotonic() + 15

    async def look(jid: str) -> None:
        async with sem:
            try:
                r = await http.get(f"/v1/jobs/{jid}")
            except httpx.HTTPError:
                return
        if r.status_code == 200:
            last[jid] = r.json()
            if last[jid]["status"] in terminal:
                pending.discard(jid)

    while pending and time.monotonic() < deadline:
        await asyncio.gather(*(look(j) for j in list(pending)))
        if pending:
            if time.monotonic() >= next_note:
                log(f"  {len(job_ids) - len(pending)}/{len(job_ids)} jobs done")
                next_note = time.monotonic() + 15
            await asyncio.sleep(1.0)
    return last


def _latency(job: dict, posted: float) -> float | None:
    """Accept to close: the workflow's close time minus its start (created_at), or minus the POST."""
    try:
        closed = datetime.fromisoformat(job["updated_at"]).timestamp()
        created = datetime.fromisoformat(job["created_at"]).timestamp() if job.get("created_at") else posted
    except (KeyError, TypeError, ValueError):
        return None
    return closed - created


async def run_one(stack, rate: float, n_chats: int, n_ingests: int, deadline_s: float, question: str,
                  collection: str, terminal: tuple[str, ...], log) -> dict:  # noqa: ANN001
    faults = {"rate": rate, "kinds": KINDS, "seed": SEED} if rate > 0 else {"rate": 0.0}
    await stack.llm_control(clear_calls=True, faults=faults, retry_after=1)
    tag = f"f{int(rate * 100)}-{uuid.uuid4().hex[:6]}"
    t0 = time.monotonic()
    async with procs.client(stack.api_url, 120) as http:
        (chats, chat_err), (ings, ing_err) = await asyncio.gather(
            _post_chats(http, tag, n_chats, question, collection), _post_ingests(http, tag, n_ingests))
        posted = dict(chats + ings)
        last = await _wait_all(http, list(posted), t0 + deadline_s, terminal, log)
    wall = time.monotonic() - t0
    await stack.llm_control(faults={"rate": 0.0})
    stats = await stack.llm_stats()

    def digest(jobs: list[tuple[str, float]], submitted: int) -> dict:
        views = [last.get(j) for j, _ in jobs]
        done = [(v, posted[j]) for (j, _), v in zip(jobs, views) if v and v["status"] == "completed"]
        lat = sorted(x for x in (_latency(v, p) for v, p in done) if x is not None)
        steps = [s for v in views if v for s in v.get("steps", [])]
        statuses: dict[str, int] = {}
        for v in views:
            st = v["status"] if v else "unknown"
            statuses[st] = statuses.get(st, 0) + 1
        return {"submitted": submitted, "accepted": len(jobs), "completed": len(done), "statuses": statuses,
                "p50": percentile(lat, 50), "p99": percentile(lat, 99), "max": lat[-1] if lat else None,
                "retried_steps": sum(1 for s in steps if (s.get("attempts") or 1) > 1),
                "extra_attempts": sum(max(0, (s.get("attempts") or 1) - 1) for s in steps),
                "problems": [f"{j}: {v['status']} {v.get('error')}" for (j, _), v in zip(jobs, views)
                             if v and v["status"] != "completed"][:5]}

    by_task = stats.get("by_task") or {}
    chat_calls = sum(v["total"] for k, v in by_task.items() if k != "embeddings")
    chat_ok = sum(v["ok"] for k, v in by_task.items() if k != "embeddings")
    out = {"rate": rate, "wall": round(wall, 1), "chat": digest(chats, n_chats), "ingest": digest(ings, n_ingests),
           "post_errors": (chat_err + ing_err)[:5], "model_calls": chat_calls, "model_ok": chat_ok,
           "faults": stats.get("faults") or {}, "by_task": by_task}
    c = out["chat"]
    log(f"  rate {rate:.0%}: chats {c['completed']}/{n_chats}, ingests {out['ingest']['completed']}/{n_ingests}, "
        f"{chat_calls} model calls ({sum(out['faults'].values())} faults), wall {wall:.1f} s")
    return out


MODEL_STEPS = ("generate_answer", "summarize_context", "extract_entities")


def model_step_policies(settings) -> dict:  # noqa: ANN001 - ragline.settings.Settings
    """The retry policies of the chat turn's model steps, from the policy file the worker loads."""
    import worker
    from temporal import policies

    path = settings.policies or policies.DEFAULT_FILE
    loaded = policies.parse(path.read_text(), worker.activity_names(), str(path))
    out = {}
    for name in MODEL_STEPS:
        p = loaded[name]
        out[name] = {"attempts": p.retry.maximum_attempts, "initial": p.retry.initial_interval.total_seconds(),
                     "backoff": p.retry.backoff_coefficient,
                     "max_interval": p.retry.maximum_interval.total_seconds() if p.retry.maximum_interval else None,
                     "start_to_close": p.start_to_close.total_seconds()}
    try:
        shown = str(path.resolve().relative_to(ROOT))
    except ValueError:
        shown = str(path)
    return {"file": shown, "env": config.env_name("policies"), "steps": out}


async def measure(stack, args, question: str, collection: str, terminal: tuple[str, ...], log) -> dict:  # noqa: ANN001
    """Restart the worker with a short model timeout (LLM_TIMEOUT), then the workload at 0 and at --fault-rate."""
    timeout_env = config.env_name("llm_timeout")
    log(f"fault bench: restarting the worker with {timeout_env}={LLM_TIMEOUT}")
    await stack.restart_worker({timeout_env: str(LLM_TIMEOUT)})
    worker_settings = stack.worker_settings
    await stack.llm_control(delay=args.fault_delay)
    runs = []
    for rate in (0.0, args.fault_rate):
        log(f"fault bench: {args.fault_chats} chats over {SESSIONS} sessions + {args.fault_ingests} ingestions, "
            f"{rate:.0%} faults, model delay {args.fault_delay:g} s")
        runs.append(await run_one(stack, rate, args.fault_chats, args.fault_ingests, args.fault_deadline,
                                  question, collection, terminal, log))
    return {"params": {"chats": args.fault_chats, "ingests": args.fault_ingests, "rate": args.fault_rate,
                       "delay": args.fault_delay, "deadline": args.fault_deadline, "sessions": SESSIONS,
                       "kinds": KINDS, "seed": SEED, "llm_timeout": worker_settings.llm_timeout,
                       "llm_timeout_name": timeout_env, "policies": model_step_policies(worker_settings)},
            "runs": runs}


def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "none"
    for unit, size in (("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _policy_text(pol: dict) -> str:
    """`temporal/policies.toml` (model steps: 6 attempts, backoff from 1s, x2, at most 1m apart), from the file."""
    kinds = {(v["attempts"], v["initial"], v["backoff"], v["max_interval"]) for v in pol["steps"].values()}
    parts = []
    for attempts, initial, backoff, max_interval in sorted(kinds, key=str):
        names = [k for k, v in pol["steps"].items()
                 if (v["attempts"], v["initial"], v["backoff"], v["max_interval"]) == (attempts, initial, backoff,
                                                                                        max_interval)]
        who = "model steps" if len(kinds) == 1 else ", ".join(f"`{n}`" for n in names)
        parts.append(f"{who}: {attempts or 'unlimited'} attempts, backoff from {_dur(initial)}, ×{backoff:g}, "
                     f"at most {_dur(max_interval)} apart")
    return f"the policy file `{pol['file']}` ({'; '.join(parts)})"


def _pct(a: int, b: int) -> str:
    return f"{a}/{b} ({100 * a / b:.0f}%)" if b else "–"


def render(r: dict, machine: dict) -> str:
    p = r["params"]
    lines = [HEADING, ""]
    lines.append(
        f"Measured {machine['date']} on {machine['nproc']} CPUs, same run and stack as above (commit "
        f"`{machine['commit'] or '?'}`). Command: `python -m bench --fault-chats {p['chats']} --fault-ingests "
        f"{p['ingests']} --fault-rate {p['rate']:g}`"
        f"{' (the defaults)' if (p['chats'], p['ingests'], p['rate'], p['delay']) == (40, 5, 0.12, 0.5) else ''}. The same workload runs once per fault rate: "
        f"{p['chats']} chat turns over {p['sessions']} sessions (turns of a session posted in order, sessions in "
        f"parallel) against the collection with one ingested document, so every turn makes 3 model calls "
        f"(summarize, extract_entities, answer), plus {p['ingests']} small text documents, one upload each, all "
        f"submitted at once. The scripted model answers each chat completion after {p['delay']:g} s; with faults "
        f"on, each chat completion fails with that probability (kinds {', '.join(p['kinds'])}, uniformly, "
        f"seed {p['seed']}; 429 carries `Retry-After: 1`; embeddings run in-process and see no faults). The worker "
        f"runs with `{p['llm_timeout_name']}={p['llm_timeout']:g}` (a hang costs {p['llm_timeout']:g} s) and "
        f"{_policy_text(p['policies'])}. Latency is per job, from its "
        f"acceptance to its workflow's close (`created_at` → `updated_at` of `GET /v1/jobs/{{id}}`), completed jobs "
        f"only, nearest-rank percentiles; deadline {p['deadline']:.0f} s per rate.")
    lines.append("")
    lines.append("| injected faults | chats completed | chat p50 | chat p99 | ingestions completed | ingest p50 | "
                 "ingest p99 | model calls per chat job (faults) | steps retried (extra attempts) | wall |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for run in r["runs"]:
        c, i = run["chat"], run["ingest"]
        nfault = sum(run["faults"].values())
        per = f"{run['model_calls'] / c['accepted']:.2f}" if c["accepted"] else "–"
        per_f = f"{nfault / c['accepted']:.2f}" if c["accepted"] else "–"
        retried = c["retried_steps"] + i["retried_steps"]
        extra = c["extra_attempts"] + i["extra_attempts"]
        lines.append(f"| {run['rate']:.0%} | {_pct(c['completed'], c['submitted'])} | {report.secs(c['p50'])} | "
                     f"{report.secs(c['p99'])} | {_pct(i['completed'], i['submitted'])} | {report.secs(i['p50'])} | "
                     f"{report.secs(i['p99'])} | {per} ({per_f}): {run['model_calls']} calls, {nfault} faults | "
                     f"{retried} ({extra}) | {report.secs(run['wall'])} |")
    lines.append("")
    notes = []
    for run in r["runs"]:
        if run["faults"]:
            kinds = ", ".join(f"{k} × {v}" for k, v in sorted(run["faults"].items()))
            notes.append(f"At {run['rate']:.0%}: faults injected {kinds}; "
                         f"{run['model_calls'] - sum(run['faults'].values())} model calls answered.")
        problems = run["chat"]["problems"] + run["ingest"]["problems"] + run["post_errors"]
        if problems:
            notes.append(f"**At {run['rate']:.0%}, not completed:** " + "; ".join(problems))
    notes.append("Chat latency includes waiting behind the earlier turns of the same session (turns of a session "
                 "run strictly in order).")
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"
