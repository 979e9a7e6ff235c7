"""What the Temporal server alone charges for Ragline's acceptance write: `python -m bench.accept_ops`.

Issue 9 holds `POST /v1/chats` to 1.2 x a bare `start_workflow` (p50). This measures, with no API, no
worker and nobody polling, bursts of the Temporal operation behind each 202 next to the floor's, on one
fresh dev server, round by round in turn:

  start, bare            the floor: `start_workflow` of a no-op type, no input
  signal-with-start      the same with a start signal (what orders a session's turns)
  + input, attributes    the session's input, the turn as the signal's argument, its three search
                         attributes; once through Ragline's client (payload encryption), once without
  start + input, attributes   what starting the turn's own workflow instead would send

Latency is each call's, from the client's side; CPU is the dev server's (with its children) over the
burst.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from temporalio.client import Client
from temporalio.common import SearchAttributePair, TypedSearchAttributes

from bench.measure import percentile
from bench.procs import free_port, temporal_ports

TURN = {"tenant": "bench", "job_id": "bench.chat-" + "0" * 52, "session_id": "s" * 32,
        "question": {"message": "Which company runs the Lisbon data centre, and what does it use for cooling?",
                     "collection": "bench", "top_k": 5},
        "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "accepted_at": "2026-12-01T12:00:00+00:00",
        "fairness_weight": 1.0, "request": None}


def server_cpu(pid: int) -> float:
    """CPU seconds of the process and its direct children (the CLI runs the server in one)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry) == pid or int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


async def main(n: int, rounds: int) -> None:
    from devtools.devserver import DevServer
    from ragline.settings import Settings
    from temporal import search_attributes as sa
    from temporal.client import connect

    t_port, ui_port = temporal_ports()
    settings = Settings(data_dir=Path(tempfile.mkdtemp(prefix="ragline-accept-ops-")),
                        temporal_address=f"127.0.0.1:{t_port}", temporal_ui_port=ui_port,
                        worker_metrics_port=free_port())
    server = DevServer(settings, startup_timeout=60)
    await server.start()
    try:
        bare = await Client.connect(settings.temporal_address)
        ragline = await connect(settings)
        attributes = TypedSearchAttributes([SearchAttributePair(sa.JOB_KIND, "chat_session"),
                                            SearchAttributePair(sa.SESSION, "s" * 32),
                                            SearchAttributePair(sa.TENANT, "bench")])
        session = {"tenant": "bench", "session_id": "s" * 32}

        def start(client: Client, full: bool) -> Callable[[str], Awaitable]:
            extra = {"search_attributes": attributes} if full else {}
            return lambda wid: client.start_workflow("BenchNoop", *([TURN] if full else []), id=wid,
                                                     task_queue="unpolled", **extra)

        def signal_with_start(client: Client, full: bool) -> Callable[[str], Awaitable]:
            extra = {"search_attributes": attributes} if full else {}
            return lambda wid: client.start_workflow("BenchNoop", *([session] if full else []), id=wid,
                                                     task_queue="unpolled", start_signal="submit",
                                                     start_signal_args=[TURN if full else {}], **extra)

        variants = {"start, bare (the floor)": start(bare, False),
                    "signal-with-start, bare": signal_with_start(bare, False),
                    "signal-with-start + input, attributes (Ragline's client: encrypted)": signal_with_start(ragline, True),
                    "signal-with-start + input, attributes (plain payloads)": signal_with_start(bare, True),
                    "start + input, attributes (Ragline's client)": start(ragline, True)}
        for name, call in variants.items():  # warm: connections, the namespace's caches
            await asyncio.gather(*(call(f"warm-{uuid.uuid4().hex}") for _ in range(20)))
        results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in variants}
        for _ in range(rounds):
            for name, call in variants.items():
                latencies: list[float] = []

                async def one(wid: str) -> None:
                    t0 = time.perf_counter()
                    await call(wid)
                    latencies.append(time.perf_counter() - t0)

                cpu0 = server_cpu(server.pid)
                await asyncio.gather(*(one(f"ops-{uuid.uuid4().hex}") for _ in range(n)))
                cpu = server_cpu(server.pid) - cpu0
                latencies.sort()
                results[name].append((percentile(latencies, 50), percentile(latencies, 99), cpu))
                await asyncio.sleep(1.0)
        floor = statistics.median(r[0] for r in results["start, bare (the floor)"])
        print(f"{n} concurrent calls per burst, {rounds} rounds, medians over the rounds")
        print("| operation | p50 | p99 | ÷ floor p50 | server CPU-s per burst | p50 by round |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name, rows in results.items():
            p50 = statistics.median(r[0] for r in rows)
            print(f"| {name} | {p50 * 1000:.0f} ms | {statistics.median(r[1] for r in rows) * 1000:.0f} ms | "
                  f"{p50 / floor:.2f} | {statistics.median(r[2] for r in rows):.2f} | "
                  + ", ".join(f"{r[0] * 1000:.0f}" for r in rows) + " |")
    finally:
        await server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="concurrent calls per burst (default 200)")
    parser.add_argument("--rounds", type=int, default=4, help="bursts of each operation (default 4)")
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.rounds))
