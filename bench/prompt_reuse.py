"""What a chat turn's model calls cost on the local llama.cpp server, by how their prompts open:
`python -m bench.prompt_reuse`.

llama-cpp-python's server keeps the prompt it evaluated last and evaluates only what follows the opening
a new prompt shares with it. A turn makes three calls on the same passages (the answer, then the summary
and the entities) and a follow-up often retrieves the same passages again. Two layouts of the same
prompts (ragline/prompts.toml), round by round in turn, on one server:

  own system prompt   the summary's and the entities' instructions in their own system message, the
                      passages after them (the layout before): every call evaluates the passages again
  shared opening      they open like the answer (its system prompt, the passages), their instructions
                      after the passages (Ragline now): after the answer, each call evaluates only what
                      follows the passages
The answer's prompt is the same in both.

Each round (the layouts take turns going first) empties the server's prompt cache first (a one-token
call with another prompt), then makes
the turn's calls one after another, as a worker with one model slot does: answer, summarize,
extract_entities, then a follow-up answer on the same passages. Passages: sections of README.md, about
the size retrieval hands a turn (top 5 chunks, ~1,200 prompt tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "How does a person approve an answer that waits for review?"
FOLLOW_UP = "And what happens when nobody reviews it?"
STEPS = ("answer", "summarize", "extract_entities", "follow-up")


BENCH_DOCUMENT = False  # --bench-document: the short document of `python -m bench` instead


def passages(n: int = 5, chars: int = 1000) -> list[SimpleNamespace]:
    """`n` README sections of about `chars` characters, as retrieval would number them."""
    if BENCH_DOCUMENT:
        from bench.run import DOCUMENT

        return [SimpleNamespace(filename="bench.txt", page=1, text=" ".join(DOCUMENT.split()))]
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    sections = [s.strip() for s in re.split(r"\n## ", text) if "review" in s.lower()]
    return [SimpleNamespace(filename="README.md", page=i + 1, text=" ".join(s.split())[:chars])
            for i, s in enumerate(sections[:n])]


def own_system_prompt(messages: list[dict]) -> list[dict]:
    """The same prompt with the step's instructions (its TASK block after the passages) moved into its own
    system message. The answer's prompt has none: it is the same in both layouts."""
    user = messages[1]["content"]
    if "\n\nTASK: " not in user:
        return messages
    opening, after = user.split("\n\nTASK: ", 1)
    task, rest = after.split("\n\n", 1)
    return [{"role": "system", "content": f"TASK: {task}"}, {"role": "user", "content": f"{opening}\n\n{rest}"}]


def turn_prompts(layout: str) -> list[tuple[str, list[dict]]]:
    from ragline import prompts

    context = prompts.format_passages(passages())
    if BENCH_DOCUMENT:
        from bench.run import FOLLOW_UP_QUESTION as follow_up
        from bench.run import QUESTION as question
        said = "Northwind runs it and cools it with seawater [1]."
    else:
        question, follow_up, said = QUESTION, FOLLOW_UP, "Approve it with POST /v1/jobs/{id}/review [1]."
    calls = [("answer", prompts.messages("answer", passages=context, history="(none)", question=question)),
             ("summarize", prompts.messages("summarize", passages=context, question=question)),
             ("extract_entities", prompts.messages("extract_entities", passages=context, question=question)),
             ("follow-up", prompts.messages("answer", passages=context, question=follow_up,
                                            history=f"Q: {question}\nA: {said}"))]
    return [(step, own_system_prompt(m) if layout == "own system prompt" else m) for step, m in calls]


async def call(oai, messages: list[dict], max_tokens: int) -> dict:  # noqa: ANN001
    t0 = time.perf_counter()
    first = None
    stream = await oai.chat.completions.create(model="local", messages=messages, temperature=0.0,
                                               max_tokens=max_tokens, stream=True,
                                               stream_options={"include_usage": True})
    pieces = []
    async for chunk in stream:
        for c in chunk.choices:
            if c.delta and c.delta.content:
                first = first if first is not None else time.perf_counter() - t0
                pieces.append(c.delta.content)
    return {"seconds": time.perf_counter() - t0, "first_piece": first, "reply": "".join(pieces)}


async def main(rounds: int, out: Path | None) -> None:
    from openai import AsyncOpenAI

    from bench import config, ratios
    from bench.procs import free_port
    from devtools.localmodel import ensure_model, llama_server_argv
    from ragline.settings import Settings

    key = Settings.model_fields["local_model"].default
    folder, why = ratios.local_model_file(ROOT, key)
    if folder is None:
        sys.exit(f"no local model: {why}")
    port = free_port()
    settings = config.settings_from_env({config.env_name("local_model"): key, config.env_name("llm_port"): str(port)})
    model_path = ensure_model(settings, models_dir=folder)
    max_tokens = settings.llm_max_tokens
    with tempfile.TemporaryFile() as log:
        server = await asyncio.create_subprocess_exec(*llama_server_argv(settings, model_path), stdout=log, stderr=log)
        oai = AsyncOpenAI(base_url=settings.effective_llm_base_url, api_key="unused", max_retries=0, timeout=600)
        try:
            for _ in range(600):
                try:
                    await oai.models.list()
                    break
                except Exception:  # noqa: BLE001 - not up yet
                    await asyncio.sleep(0.5)
            print(f"llama.cpp with {model_path.name}, {len(passages())} passages, {rounds} round(s) per layout",
                  flush=True)
            results: dict[str, list[dict]] = {"own system prompt": [], "shared opening": []}
            for r in range(rounds):
                for layout in (list(results) if r % 2 == 0 else list(reversed(results))):  # either goes first
                    await call(oai, [{"role": "user", "content": f"Say OK ({r}, {layout})."}], 1)  # empties the cache
                    row = {}
                    for step, messages in turn_prompts(layout):
                        row[step] = await call(oai, messages, max_tokens)
                    results[layout].append(row)
                    print(f"round {r + 1}, {layout}: " + ", ".join(
                        f"{s} {v['seconds']:.1f} s" for s, v in row.items()), flush=True)
                    for s, v in row.items():
                        print(f"    {s}: {' '.join(v['reply'].split())[:160]}", flush=True)
        finally:
            server.terminate()
            await server.wait()
    columns = [f"{s} (s)" for s in STEPS] + ["follow-up first piece (s)", "turn's three calls (s)"]
    print("\n| layout | " + " | ".join(columns) + " |")
    print("| --- |" + " --- |" * (len(STEPS) + 2))
    for layout, rows in results.items():
        med = {s: statistics.median(r[s]["seconds"] for r in rows) for s in STEPS}
        first = statistics.median(r["follow-up"]["first_piece"] or 0 for r in rows)
        three = statistics.median(sum(r[s]["seconds"] for s in STEPS[:3]) for r in rows)
        print(f"| {layout} | " + " | ".join(f"{med[s]:.1f}" for s in STEPS) + f" | {first:.1f} | {three:.1f} |")
    if out:
        out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", type=Path, default=None, help="write every call's numbers here")
    p.add_argument("--bench-document", action="store_true",
                   help="the short document `python -m bench` asks about, instead of README sections")
    a = p.parse_args()
    BENCH_DOCUMENT = a.bench_document
    asyncio.run(main(a.rounds, a.json))
