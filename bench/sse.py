"""A chat turn as a client sees it: POST /v1/chats, then GET /v1/jobs/{id}/events (Server-Sent Events)
until the terminal event, with the moment each interesting event arrived (seconds after the POST was sent)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

import httpx

TERMINAL_TYPES = ("ragline.job.completed", "ragline.job.failed", "ragline.job.cancelled")
FIRST_DELTA = "ragline.answer.delta"


@dataclass
class TurnTimes:
    session_id: str
    job_id: str | None = None
    wall_post: float = 0.0              # time.time() when the POST was sent
    accepted: float | None = None       # POST sent -> 202 received
    first_delta: float | None = None    # POST sent -> first ragline.answer.delta received
    answer_completed: float | None = None
    terminal: float | None = None       # POST sent -> terminal event received
    terminal_type: str | None = None
    status: int | None = None           # HTTP status of the POST
    error: str | None = None
    events: int = 0
    deltas: int = 0
    first_delta_attempt: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def completed(self) -> bool:
        return self.terminal_type == "ragline.job.completed"

    def as_dict(self) -> dict:
        return asdict(self)


async def watch(http: httpx.AsyncClient, job_id: str, t0: float, times: TurnTimes) -> None:
    """Read the job's SSE stream until its terminal event; fills `times` (offsets from perf_counter t0)."""
    async with http.stream("GET", f"/v1/jobs/{job_id}/events") as r:
        if r.status_code != 200:
            body = (await r.aread())[:200].decode(errors="replace")
            times.error = f"events: HTTP {r.status_code} {body}"
            return
        data: list[str] = []
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                data.append(line[5:].lstrip())
                continue
            if line or not data:
                continue
            now = time.perf_counter() - t0
            try:
                event = json.loads("\n".join(data))
            except ValueError:
                data = []
                continue
            data = []
            times.events += 1
            kind = event.get("type")
            if kind == FIRST_DELTA:
                times.deltas += 1
                if times.first_delta is None:
                    times.first_delta = now
                    times.first_delta_attempt = (event.get("data") or {}).get("attempt")
            elif kind == "ragline.answer.completed" and times.answer_completed is None:
                times.answer_completed = now
            elif kind in TERMINAL_TYPES:
                times.terminal = now
                times.terminal_type = kind
                return
    if times.terminal_type is None and times.error is None:
        times.error = "event stream ended before a terminal event"


async def chat_turn(http: httpx.AsyncClient, body: dict, timeout: float, *, follow: bool = True,
                    headers: dict[str, str] | None = None) -> TurnTimes:
    """POST the turn and, with `follow`, read its events to the end. Never raises: failures land in `error`."""
    times = TurnTimes(session_id=body.get("session_id") or "")
    times.wall_post = time.time()
    t0 = time.perf_counter()
    try:
        r = await asyncio.wait_for(http.post("/v1/chats", json=body, headers=headers), timeout)
        times.accepted = time.perf_counter() - t0
        times.status = r.status_code
        if r.status_code != 202:
            times.error = f"HTTP {r.status_code} {r.text[:160]}"
            return times
        times.job_id = r.json()["job_id"]
        if follow:
            await asyncio.wait_for(watch(http, times.job_id, t0, times), max(1.0, timeout - times.accepted))
    except asyncio.TimeoutError:
        times.error = f"timeout after {timeout:.0f} s"
    except Exception as exc:  # noqa: BLE001 - every failure is a data point
        times.error = f"{type(exc).__name__}: {str(exc)[:160]}"
    return times
