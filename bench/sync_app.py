"""The baseline of `make bench`: a plain synchronous FastAPI app that calls the model inline.

    BENCH_LLM_BASE_URL=http://127.0.0.1:8999/v1 uvicorn bench.sync_app:app --workers 1

`POST /v1/chats` is a `def` endpoint, so FastAPI runs it in its thread pool (anyio's default limiter:
40 threads); each request makes one blocking chat completion through the official `openai` client
and answers 200 with the model's reply only after the call returns. No queue, no durability, no
retries: what most "first version" GenAI endpoints look like.
"""

from __future__ import annotations

import os
import uuid

from fastapi import FastAPI
from openai import OpenAI
from pydantic import BaseModel, Field

SYSTEM_PROMPT = "TASK: answer\nAnswer the question from the passages; cite them as [n]."

client = OpenAI(base_url=os.environ.get("BENCH_LLM_BASE_URL", "http://127.0.0.1:8999/v1"),
                api_key=os.environ.get("BENCH_LLM_API_KEY", "unused"), max_retries=0,
                timeout=float(os.environ.get("BENCH_LLM_TIMEOUT", "120")))
MODEL = os.environ.get("BENCH_LLM_MODEL", "scripted")

app = FastAPI(title="bench sync baseline")


class ChatRequest(BaseModel):
    message: str = Field(min_length=1, max_length=8000)
    session_id: str | None = None
    collection: str = "default"


# No return annotation and no response_model on purpose: FastAPI (0.1xx) validates the return value of a
# `def` endpoint that declares one in the same 40-thread pool, so a finished request would wait for a
# thread behind every request still queued for one, and no response would leave before the last model
# call ended (measured: p50 27 s instead of ~15 s for 200 requests with a 5 s model).
@app.post("/v1/chats")
def post_chat(req: ChatRequest):  # noqa: ANN201
    response = client.chat.completions.create(
        model=MODEL, max_tokens=512, temperature=0.0,
        messages=[{"role": "system", "content": SYSTEM_PROMPT},
                  {"role": "user", "content": f"[1] (bench.txt, page 1) Ragline runs every chat turn as a "
                                              f"durable workflow.\nQUESTION: {req.message}"}])
    return {"session_id": req.session_id or uuid.uuid4().hex, "answer": response.choices[0].message.content}


@app.get("/healthz")
def healthz():  # noqa: ANN201
    return {"status": "up"}


@app.get("/limits")
async def limits():  # noqa: ANN201
    """The thread pool the `def` endpoints run in (anyio's default limiter), for the report."""
    import anyio.to_thread

    return {"threads": anyio.to_thread.current_default_thread_limiter().total_tokens}
