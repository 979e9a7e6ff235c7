"""Ragline against its floors (issue 9), measured on the stack of bench/run.py in the same run:

  in order    N POST /v1/chats over S sessions, each session's requests one after another (sessions in
              parallel), next to the same pattern of bare start_workflow calls and of sync-app requests;
              then every turn's number (GET /v1/jobs/{id} `turn`) is checked against the send order.
  burst       N chats at once, each client POSTs then reads its job's events (SSE): POST -> first
              `ragline.answer.delta`, against the sync app's response time at the same model delay.
  first delta sequential turns, POST -> first `ragline.answer.delta`, against one bare streamed
              chat completion with the same prompt to the same model server (time to first token);
              with the scripted model, and with the local llama.cpp model when it is installed.
  overhead    with a model that answers at once, POST -> `ragline.job.completed` against a bare workflow
              that runs one activity (bench/floor_worker.py), where the turn's time goes (histories).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench import procs, timeline
from bench.measure import Burst, burst, percentile, sequences
from bench.sse import TurnTimes, chat_turn, watch
from models.chat import session_workflow_id

Log = Callable[[str], None]


def _client(base_url: str, n: int, timeout: float) -> httpx.AsyncClient:
    return procs.client(base_url, httpx.Timeout(timeout, connect=60.0), n)


def stats(values: list[float | None]) -> dict[str, Any]:
    v = sorted(x for x in values if x is not None)
    return {"n": len(v), "p50": percentile(v, 50), "p90": percentile(v, 90), "p99": percentile(v, 99),
            "min": v[0] if v else None, "max": v[-1] if v else None}


# --------------------------------------------------------------------------------------------------
# acceptance, each session's requests in order


async def in_order(stack, client, *, tenant: str, sessions: int, per_session: int, timeout: float, question: str,  # noqa: ANN001
                   collection: str, noop_workflow: str, noop_queue: str, log: Log) -> dict:
    run = uuid.uuid4().hex[:8]
    total = sessions * per_session
    out: dict[str, Any] = {"sessions": sessions, "per_session": per_session, "requests": total}

    log(f"[in order 1/3] floor: {sessions} clients x {per_session} start_workflow('{noop_workflow}') one "
        f"after another")

    async def floor_call(s: int, j: int):
        h = await client.start_workflow(noop_workflow, id=f"bench-noop-seq-{run}-{s}-{j}", task_queue=noop_queue)
        return True, None, h.id

    floor = await sequences("floor", sessions, per_session, floor_call, timeout)
    out["floor"] = floor.summary()
    log(f"      p50 {floor.summary()['p50'] * 1000:.1f} ms, errors {len(floor.errors)}")
    await asyncio.sleep(1)

    def body(tag: str, s: int, j: int) -> dict:
        return {"message": f"{question} (s{s} #{j})", "collection": collection, "session_id": f"{tag}-s{s}"}

    log(f"[in order 2/3] sync app: {sessions} clients x {per_session} POST /v1/chats one after another")
    stag = f"sseq-{run}"
    async with _client(stack.sync_url, sessions, timeout) as http:
        async def sync_call(s: int, j: int):
            r = await http.post("/v1/chats", json=body(stag, s, j))
            return r.status_code == 200, r.status_code, None

        sync = await sequences("sync", sessions, per_session, sync_call, timeout)
    out["sync"] = sync.summary()
    log(f"      p50 {sync.summary()['p50']:.2f} s, wall {sync.wall:.1f} s, errors {len(sync.errors)}")
    await asyncio.sleep(1)

    log(f"[in order 3/3] Ragline: {sessions} sessions x {per_session} POST /v1/chats, each session's in order")
    tag = f"rseq-{run}"
    async with _client(stack.api_url, sessions, timeout) as http:
        async def rl_call(s: int, j: int):
            r = await http.post("/v1/chats", json=body(tag, s, j))
            try:
                data = r.json()
            except ValueError:
                data = r.text[:200]
            return r.status_code == 202, r.status_code, data

        ragline = await sequences("ragline", sessions, per_session, rl_call, timeout)
    out["ragline"] = ragline.summary()
    statuses: dict[str, int] = {}
    for x in ragline.samples:
        key = str(x.status) if x.status is not None else (x.error or "no answer").split(":")[0]
        statuses[key] = statuses.get(key, 0) + 1
    out["statuses"] = statuses
    out["http_5xx"] = sum(1 for x in ragline.samples if x.status is not None and x.status >= 500)
    log(f"      p50 {ragline.summary()['p50'] * 1000:.1f} ms, wall {ragline.wall:.1f} s, statuses {statuses}")

    # Turn numbers, in send order per session
    jobs: dict[int, list[str]] = {s: [] for s in range(sessions)}
    for x in ragline.samples:
        if x.ok:
            jobs[x.index // per_session].append(x.body["job_id"])
    log(f"checking the turn number of every accepted job (GET /v1/jobs/{{id}}), {sum(map(len, jobs.values()))}")
    turns = await _turn_numbers(stack.api_url, [j for js in jobs.values() for j in js], deadline=180.0)
    in_order_sessions = contiguous = 0
    problems: list[str] = []
    for s, js in jobs.items():
        nums = [turns.get(j) for j in js]
        if any(n is None for n in nums):
            problems.append(f"session {s}: {sum(n is None for n in nums)} turns never numbered")
            continue
        if all(a < b for a, b in zip(nums, nums[1:])):
            in_order_sessions += 1
        else:
            problems.append(f"session {s}: turns {nums}")
        if nums == list(range(1, len(nums) + 1)):
            contiguous += 1
    out["order"] = {"sessions": sessions, "in_order": in_order_sessions, "contiguous": contiguous,
                    "numbered": sum(1 for v in turns.values() if v is not None), "problems": problems[:5]}
    log(f"      {in_order_sessions}/{sessions} sessions numbered in send order ({contiguous} as 1..n)")

    log("terminating this phase's sessions and turns (their model calls would run for minutes)")
    ids = [session_workflow_id(tenant, f"{tag}-s{s}") for s in range(sessions)] + [j for js in jobs.values() for j in js]
    out["terminated"] = await _terminate(client, ids)
    await asyncio.sleep(3)
    return out


async def _turn_numbers(api_url: str, job_ids: list[str], deadline: float) -> dict[str, int | None]:
    found: dict[str, int | None] = {j: None for j in job_ids}
    sem = asyncio.Semaphore(16)
    end = time.monotonic() + deadline
    async with procs.client(api_url, 60) as http:
        async def one(jid: str) -> None:
            async with sem:
                try:
                    r = await http.get(f"/v1/jobs/{jid}")
                except httpx.HTTPError:
                    return
            if r.status_code == 200 and r.json().get("turn") is not None:
                found[jid] = r.json()["turn"]

        while time.monotonic() < end:
            todo = [j for j, v in found.items() if v is None]
            if not todo:
                break
            await asyncio.gather(*(one(j) for j in todo))
            if any(v is None for v in found.values()):
                await asyncio.sleep(1)
    return found


async def _terminate(client, workflow_ids: list[str]) -> int:  # noqa: ANN001
    sem = asyncio.Semaphore(32)
    done = 0

    async def one(wid: str) -> None:
        nonlocal done
        async with sem:
            try:
                await client.get_workflow_handle(wid).terminate(reason="bench: phase over")
                done += 1
            except Exception:  # noqa: BLE001 - already closed
                pass

    await asyncio.gather(*(one(w) for w in workflow_ids))
    return done


# --------------------------------------------------------------------------------------------------
# a burst of chats, each followed on its event stream


async def burst_stream(api_url: str, client, n: int, timeout: float, question: str, collection: str,  # noqa: ANN001
                       log: Log) -> dict:
    tag = f"bst-{uuid.uuid4().hex[:8]}"
    async with _client(api_url, 2 * n, timeout) as http:
        async def call(i: int):
            t = await chat_turn(http, {"message": f"{question} (#{i})", "collection": collection,
                                       "session_id": f"{tag}-{i}"}, timeout)
            return t.completed, t.status, t

        b: Burst = await burst("burst", n, call, timeout + 10)
    turns: list[TurnTimes] = [s.body for s in b.samples if isinstance(s.body, TurnTimes)]
    out = {"n": n, "completed": sum(1 for t in turns if t.completed),
           "accepted": sum(1 for t in turns if t.status == 202),
           "http_5xx": sum(1 for t in turns if t.status is not None and t.status >= 500),
           "errors": [t.error for t in turns if t.error][:5],
           "accept": stats([t.accepted for t in turns]),
           "first_delta": stats([t.first_delta for t in turns]),
           "answer_completed": stats([t.answer_completed for t in turns]),
           "terminal": stats([t.terminal for t in turns]),
           "no_delta": sum(1 for t in turns if t.first_delta is None),
           "wall": b.wall, "turns": [t.as_dict() for t in turns]}
    log(f"      {out['completed']}/{n} completed, first delta p50 {_ms(out['first_delta']['p50'])}, "
        f"all done after {b.wall:.1f} s; reading the {n} turns' histories")
    timelines = await timeline.turn_timelines(client, turns)
    out["segments"] = timeline.segment_stats(timelines, timeline.FIRST_DELTA_SEGMENTS, stats)
    out["turn_segments"] = timeline.segment_stats(timelines, timeline.TURN_SEGMENTS, stats)
    return out


# --------------------------------------------------------------------------------------------------
# time to the first answer delta against a bare streamed call


def recorded_prompt(llm_stats: dict, question: str) -> list[dict] | None:
    """The messages of the last `answer` call whose question is `question`, from the scripted model's
    records: its `text` is the system message, a newline and the user message."""
    for call in reversed(llm_stats.get("calls") or []):
        if call.get("task") != "answer" or call.get("question") != question:
            continue
        user, text = call.get("user_message") or "", call.get("text") or ""
        if user and text.endswith("\n" + user):
            return [{"role": "system", "content": text[:-len(user) - 1]}, {"role": "user", "content": user}]
    return None


async def bare_stream(oai, model: str, messages: list[dict], max_tokens: int) -> dict:  # noqa: ANN001
    """One streamed chat completion as ragline.llm.ChatModel.stream makes it: time to the first content
    piece, and to the end."""
    t0 = time.perf_counter()
    first = None
    pieces = 0
    stream = await oai.chat.completions.create(model=model, messages=messages, temperature=0.0,
                                               max_tokens=max_tokens, stream=True,
                                               stream_options={"include_usage": True})
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta and choice.delta.content:
                pieces += 1
                if first is None:
                    first = time.perf_counter() - t0
    return {"ttft": first, "total": time.perf_counter() - t0, "pieces": pieces}


async def flush_model(oai, model: str) -> None:  # noqa: ANN001
    """One unrelated 1-token call: llama.cpp then holds no prefix of the next prompt in its cache."""
    await oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say OK."}],
                                      max_tokens=1, temperature=0.0)


async def first_delta(api_url: str, client, llm_base_url: str, model: str, max_tokens: int,  # noqa: ANN001
                      messages: list[dict], turns: int, question: str, collection: str, timeout: float, log: Log,
                      flush: bool = False) -> dict:
    """`turns` rounds of (a chat turn in a fresh session, followed to its end) and (a bare streamed call
    with the prompt that turn's answer step sends), alternating which goes first."""
    from openai import AsyncOpenAI

    tag = f"ttfd-{uuid.uuid4().hex[:8]}"
    oai = AsyncOpenAI(base_url=llm_base_url, api_key="unused", max_retries=0, timeout=timeout)
    rows = []
    async with _client(api_url, 4, timeout) as http:
        try:
            for i in range(turns):
                async def turn() -> TurnTimes:
                    if flush:
                        await flush_model(oai, model)
                    return await chat_turn(http, {"message": question, "collection": collection,
                                                  "session_id": f"{tag}-{i}"}, timeout)

                async def bare() -> dict:
                    if flush:
                        await flush_model(oai, model)
                    return await bare_stream(oai, model, messages, max_tokens)

                if i % 2 == 0:
                    t, b = await turn(), await bare()
                else:
                    b = await bare()
                    t = await turn()
                rows.append({"turn": t.as_dict(), "bare": b,
                             "timeline": (await timeline.turn_timelines(client, [t]))[0]})
                log(f"  turn {i + 1}/{turns}: first delta {_ms(t.first_delta)}, bare TTFT {_ms(b['ttft'])}"
                    + (f" ({t.error})" if t.error else ""))
        finally:
            await oai.close()
    ragline = stats([r["turn"]["first_delta"] for r in rows])
    floor = stats([r["bare"]["ttft"] for r in rows])
    return {"turns": turns, "ragline": ragline, "bare": floor,
            "segments": timeline.segment_stats([r["timeline"] for r in rows], timeline.FIRST_DELTA_SEGMENTS, stats),
            "completed": sum(1 for r in rows if r["turn"]["terminal_type"] == "ragline.job.completed"),
            "bare_total": stats([r["bare"]["total"] for r in rows]),
            "turn_total": stats([r["turn"]["terminal"] for r in rows]), "rows": rows}


async def follow_up(api_url: str, llm_base_url: str, model: str, max_tokens: int,  # noqa: ANN001
                    messages: list[dict], turns: int, question: str, follow_up_question: str, collection: str,
                    timeout: float, log: Log, flush: bool = False) -> dict:
    """`turns` rounds of: a turn in a fresh session, and the moment its `ragline.answer.completed` arrives, a
    follow-up in the same session (a person who asks on as soon as the answer is there), followed to its
    end; then a bare streamed call with `messages`. The follow-up's first delta is held against the bare call's
    TTFT like a first turn's (the scripted model's TTFT does not depend on the prompt)."""
    from openai import AsyncOpenAI

    tag = f"follow-{uuid.uuid4().hex[:8]}"
    oai = AsyncOpenAI(base_url=llm_base_url, api_key="unused", max_retries=0, timeout=timeout)
    rows = []
    async with _client(api_url, 4, timeout) as http:
        try:
            for i in range(turns):
                session = f"{tag}-{i}"
                first = TurnTimes(session_id=session)
                t0 = time.perf_counter()
                r = await http.post("/v1/chats", json={"message": question, "collection": collection,
                                                       "session_id": session})
                r.raise_for_status()
                first.job_id = r.json()["job_id"]
                watching = asyncio.create_task(watch(http, first.job_id, t0, first))
                while first.answer_completed is None and not watching.done():
                    await asyncio.sleep(0.002)
                later = await chat_turn(http, {"message": follow_up_question, "collection": collection,
                                               "session_id": session}, timeout)
                await watching
                if flush:
                    await flush_model(oai, model)
                bare = await bare_stream(oai, model, messages, max_tokens)
                ended_after = (first.terminal - first.answer_completed
                               if first.terminal is not None and first.answer_completed is not None else None)
                rows.append({"first": first.as_dict(), "turn": later.as_dict(), "bare": bare,
                             "first_ended_after_answer": ended_after})
                log(f"  follow-up {i + 1}/{turns}: first delta {_ms(later.first_delta)}, bare TTFT "
                    f"{_ms(bare['ttft'])}; the turn before ended {_ms(ended_after)} after its answer"
                    + (f" ({later.error})" if later.error else ""))
        finally:
            await oai.close()
    return {"turns": turns, "ragline": stats([r["turn"]["first_delta"] for r in rows]),
            "bare": stats([r["bare"]["ttft"] for r in rows]),
            "completed": sum(1 for r in rows if r["turn"]["terminal_type"] == "ragline.job.completed"),
            "turn_total": stats([r["turn"]["terminal"] for r in rows]),
            "first_ended_after_answer": stats([r["first_ended_after_answer"] for r in rows]), "rows": rows}


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1000:.0f} ms"


# --------------------------------------------------------------------------------------------------
# the orchestration's own cost


async def overhead(api_url: str, client, *, turns: int, warm: int, floor_workflow: str, floor_queue: str,  # noqa: ANN001
                   question: str, collection: str, timeout: float, log: Log) -> dict:
    tag = f"ovh-{uuid.uuid4().hex[:8]}"
    rows = []
    async with _client(api_url, 4, timeout) as http:
        for i in range(warm + turns):
            async def turn() -> TurnTimes:
                return await chat_turn(http, {"message": f"{question} (#{i})", "collection": collection,
                                              "session_id": f"{tag}-{i}"}, timeout)

            async def bare() -> dict:
                wid = f"bench-one-step-{tag}-{i}"
                wall = time.time()
                t0 = time.perf_counter()
                await client.execute_workflow(floor_workflow, "x", id=wid, task_queue=floor_queue,
                                              result_type=str)
                return {"id": wid, "wall": wall, "total": time.perf_counter() - t0}

            if i % 2 == 0:
                t, b = await turn(), await bare()
            else:
                b = await bare()
                t = await turn()
            if i < warm:
                continue
            row: dict[str, Any] = {"turn": t.as_dict(), "bare": b}
            if t.job_id and t.completed:
                row["turn_timeline"] = await timeline.turn_timeline(client, t.job_id, t.session_id, t.wall_post,
                                                                    t.terminal, t.first_delta)
            row["bare_timeline"] = await timeline.bare_timeline(client, b["id"], b["wall"], b["total"])
            rows.append(row)
    ragline = stats([r["turn"]["terminal"] for r in rows if r["turn"]["terminal_type"] == "ragline.job.completed"])
    floor = stats([r["bare"]["total"] for r in rows])
    turn_segments = timeline.segment_stats([r.get("turn_timeline") for r in rows], timeline.TURN_SEGMENTS, stats)
    delta_segments = timeline.segment_stats([r.get("turn_timeline") for r in rows], timeline.FIRST_DELTA_SEGMENTS,
                                            stats)
    bare_segments = {name: stats([timeline.segments(r["bare_timeline"]["points"], timeline.BARE_SEGMENTS)[name]
                                  for r in rows]) for name, _ in timeline.BARE_SEGMENTS}
    history = {side: {k: stats([r["turn_timeline"][side][k] for r in rows if "turn_timeline" in r])["p50"]
                      for k in ("events", "workflow_tasks", "signals", "updates", "activities")}
               for side in ("turn", "session")}
    history["bare"] = {k: stats([r["bare_timeline"]["workflow"][k] for r in rows])["p50"]
                       for k in ("events", "workflow_tasks", "signals", "updates", "activities")}
    log(f"      turn p50 {_ms(ragline['p50'])}, bare workflow p50 {_ms(floor['p50'])}")
    return {"turns": turns, "warm": warm, "ragline": ragline, "bare": floor,
            "accept": stats([r["turn"]["accepted"] for r in rows]),
            "first_delta": stats([r["turn"]["first_delta"] for r in rows]),
            "completed": sum(1 for r in rows if r["turn"]["terminal_type"] == "ragline.job.completed"),
            "turn_segments": turn_segments, "segments": delta_segments, "bare_segments": bare_segments, "history": history, "rows": rows}


# --------------------------------------------------------------------------------------------------
# the local model


def model_dirs(root: Path) -> list[Path]:
    """Where an assembled local model may already be: the tests' cache, the data folder of `make run`."""
    dirs = [os.environ.get("RAGLINE_TEST_MODEL_DIR"), root / ".venv" / "models-cache", root / "data" / "models"]
    return [Path(d) for d in dirs if d]


def local_model_file(root: Path, key: str) -> tuple[Path | None, str | None]:
    """(an assembled, verified model file or a folder to assemble it into, None) or (None, why not)."""
    from devtools.localmodel import LocalModelError, get_model, missing_packages

    if importlib.util.find_spec("llama_cpp") is None:
        return None, "llama-cpp-python is not installed (the extra `local-llm`; `make run` or `make test` installs it)"
    try:
        model = get_model(key)
    except LocalModelError as exc:
        return None, str(exc)
    for d in model_dirs(root):
        f = d / model.filename
        if f.is_file() and f.stat().st_size == model.size:
            return d, None
    missing = missing_packages(model)
    if missing:
        return None, (f"the model file {model.filename} is not assembled in {', '.join(map(str, model_dirs(root)))} "
                      f"and its chunk packages are not installed ({missing[0]}, ...)")
    return model_dirs(root)[1], None
