"""The floor of a chat turn's orchestration: a bare workflow that runs one activity, in its own worker
process on its own task queue, on the same Temporal server as Ragline.

    python -m bench.floor_worker --address 127.0.0.1:7233 --task-queue bench-one-step

The bench starts it with `client.execute_workflow("BenchOneStep", ...)` and times start -> result, as
it times a chat turn from POST to `ragline.job.completed`. Default data converter, default options:
nothing of Ragline's (no events stream, no search attributes, no claim check).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from datetime import timedelta

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.worker import Worker

WORKFLOW = "BenchOneStep"
ACTIVITY = "bench_one_step"
READY_LINE = "bench floor worker polling"


@activity.defn(name=ACTIVITY)
async def one_step(text: str) -> str:
    return text


@workflow.defn(name=WORKFLOW)
class OneStep:
    @workflow.run
    async def run(self, text: str) -> str:
        return await workflow.execute_activity(ACTIVITY, text, start_to_close_timeout=timedelta(seconds=60),
                                               result_type=str)


async def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.floor_worker")
    p.add_argument("--address", required=True)
    p.add_argument("--namespace", default="default")
    p.add_argument("--task-queue", required=True)
    args = p.parse_args(argv)
    client = await Client.connect(args.address, namespace=args.namespace, identity="bench-floor-worker")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with Worker(client, task_queue=args.task_queue, workflows=[OneStep], activities=[one_step]):
        print(f"{READY_LINE} on {args.task_queue}", flush=True)
        await stop.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
