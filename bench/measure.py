"""Firing a burst of concurrent calls and summarising latencies."""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    index: int
    started: float          # perf_counter offset from the burst's start
    latency: float          # seconds from this call's start to its answer (or failure)
    ok: bool
    status: int | None = None
    error: str | None = None
    body: Any = None
    wall_start: float = 0.0  # time.time() when the call started (to compare with Temporal's clocks)


@dataclass
class Burst:
    name: str
    samples: list[Sample]
    wall: float             # first call started -> last call answered

    @classmethod
    def pooled(cls, name: str, bursts: list[Burst]) -> Burst:
        """Several bursts of the same calls as one set of samples (wall: the longest)."""
        return cls(name, [s for b in bursts for s in b.samples], max((b.wall for b in bursts), default=0.0))

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.ok]

    @property
    def errors(self) -> list[Sample]:
        return [s for s in self.samples if not s.ok]

    def summary(self) -> dict[str, Any]:
        """Percentiles over every request (an error counts at the moment it came back), and over the
        successful ones apart (`ok_*`)."""
        lat = sorted(s.latency for s in self.samples)
        ok = sorted(s.latency for s in self.ok)
        return {"n": len(self.samples), "ok": len(ok), "errors": len(self.errors),
                "p50": percentile(lat, 50), "p90": percentile(lat, 90), "p99": percentile(lat, 99),
                "max": lat[-1] if lat else None, "min": lat[0] if lat else None,
                "mean": sum(lat) / len(lat) if lat else None, "wall": self.wall,
                "ok_p50": percentile(ok, 50), "ok_p99": percentile(ok, 99), "ok_max": ok[-1] if ok else None,
                "error_kinds": dict(Counter(s.error or f"HTTP {s.status}" for s in self.errors)),
                "error_first": min((s.latency for s in self.errors), default=None),
                "error_last": max((s.latency for s in self.errors), default=None),
                "latencies": [round(s.latency, 4) for s in self.samples],
                "ok_latencies": [round(s.latency, 4) for s in self.ok]}


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (p99 of 200 samples is the 198th smallest)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def _describe(status: int | None, body: Any) -> str:
    code = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        code = body["error"].get("code")
    return f"HTTP {status}" + (f" {code}" if code else "")


Call = Callable[[int], Awaitable[tuple[bool, int | None, Any]]]


async def burst(name: str, n: int, call: Call, timeout: float) -> Burst:
    """Start `n` calls at once (all released by one event) and wait for every one of them.
    `call(i)` returns (ok, status, body); an exception or `timeout` counts as an error."""
    go = asyncio.Event()
    t0 = 0.0

    async def one(i: int) -> Sample:
        await go.wait()
        wall = time.time()
        start = time.perf_counter()
        try:
            ok, status, body = await asyncio.wait_for(call(i), timeout)
            return Sample(i, start - t0, time.perf_counter() - start, ok, status,
                          None if ok else _describe(status, body), body, wall)
        except asyncio.TimeoutError:
            return Sample(i, start - t0, time.perf_counter() - start, False, None, f"timeout after {timeout:.0f} s",
                          None, wall)
        except Exception as exc:  # noqa: BLE001 - every failure is a data point
            return Sample(i, start - t0, time.perf_counter() - start, False, None,
                          f"{type(exc).__name__}: {str(exc)[:120]}", None, wall)

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    await asyncio.sleep(0)  # every task is now parked on the event
    t0 = time.perf_counter()
    go.set()
    samples = await asyncio.gather(*tasks)
    ends = [s.started + s.latency for s in samples]
    return Burst(name, list(samples), max(ends) if ends else 0.0)


SessionCall = Callable[[int, int], Awaitable[tuple[bool, int | None, Any]]]


async def sequences(name: str, sessions: int, per_session: int, call: SessionCall, timeout: float) -> Burst:
    """`sessions` clients at once, each sending `per_session` calls one after another (the next once the
    previous one has answered): `call(s, j)` is session s's j-th call. Sample index s * per_session + j."""
    go = asyncio.Event()
    t0 = 0.0

    async def session(s: int) -> list[Sample]:
        await go.wait()
        out = []
        for j in range(per_session):
            i = s * per_session + j
            wall = time.time()
            start = time.perf_counter()
            try:
                ok, status, body = await asyncio.wait_for(call(s, j), timeout)
                out.append(Sample(i, start - t0, time.perf_counter() - start, ok, status,
                                  None if ok else _describe(status, body), body, wall))
            except asyncio.TimeoutError:
                out.append(Sample(i, start - t0, time.perf_counter() - start, False, None,
                                  f"timeout after {timeout:.0f} s", None, wall))
            except Exception as exc:  # noqa: BLE001 - every failure is a data point
                out.append(Sample(i, start - t0, time.perf_counter() - start, False, None,
                                  f"{type(exc).__name__}: {str(exc)[:120]}", None, wall))
        return out

    tasks = [asyncio.create_task(session(s)) for s in range(sessions)]
    await asyncio.sleep(0)
    t0 = time.perf_counter()
    go.set()
    samples = sorted((x for group in await asyncio.gather(*tasks) for x in group), key=lambda x: x.index)
    ends = [x.started + x.latency for x in samples]
    return Burst(name, samples, max(ends) if ends else 0.0)


@dataclass
class Drain:
    """Ragline's end to end: when each recorded chat job reached a terminal status. `acked` are the jobs
    answered 202; `unacked` the sessions of the requests that failed (one turn per session): a job of
    such a session that shows up anyway is a turn recorded (and run) although its client was told it failed."""
    acked: set[str]
    unacked: set[str]
    seen: dict[str, dict] = field(default_factory=dict)       # job_id -> latest summary, recorded jobs only
    done: dict[str, dict] = field(default_factory=dict)       # job_id -> job summary (terminal)
    e2e: dict[str, float] = field(default_factory=dict)       # job_id -> seconds from its POST to its close
    recorded_unacked: set[str] = field(default_factory=set)   # job ids of failed requests, recorded anyway
    observed_all_at: float | None = None                      # seconds after the burst started (by polling)
    timed_out: bool = False
    poll_errors: int = 0
    polls: int = 0

    @property
    def recorded(self) -> set[str]:
        return self.acked | self.recorded_unacked

    def statuses(self) -> dict[str, int]:
        return dict(Counter(j["status"] for j in self.done.values()))
