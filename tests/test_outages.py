"""What a user sees when a component is missing: clear errors, never a stack trace or a hang."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from api.app import create_app
from ragline import keys as api_keys
from ragline.settings import Settings
from tests.conftest import free_port

PROJECT = Path(__file__).resolve().parent.parent


async def test_api_answers_503_while_temporal_is_down(tmp_path):
    settings = Settings(data_dir=tmp_path, temporal_address=f"127.0.0.1:{free_port()}", temporal_rpc_timeout=2)
    key = api_keys.create(settings.effective_api_keys_file, "acme", "member")
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api",
                                     headers={"Authorization": f"Bearer {key}"}) as http:
            health = await http.get("/healthz")
            assert health.status_code == 503
            assert health.json()["components"]["temporal"]["status"] == "down"
            assert (await http.get("/livez")).status_code == 200  # the probes keep it in service: it answers 503s

            upload = await http.post("/v1/documents", files=[("files", ("a.txt", b"some text to keep"))])
            assert upload.status_code == 503
            assert upload.json()["error"]["code"] == "temporal_unavailable"
            assert upload.headers["Retry-After"] == "5"  # a client (or a proxy) knows when to try again

            job = await http.get("/v1/jobs/anything")
            assert job.status_code == 503 and job.headers["Retry-After"] == "5"


def test_second_worker_on_the_same_embedded_store_gets_a_clear_error(stack):
    env = {**os.environ, "RAGLINE_DATA_DIR": str(stack.settings.data_dir),
           "RAGLINE_TEMPORAL_ADDRESS": stack.settings.temporal_address}
    proc = subprocess.run([sys.executable, "worker.py"], cwd=PROJECT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 3
    output = proc.stdout + proc.stderr
    assert "already open in another process" in output and "RAGLINE_QDRANT_URL" in output
    assert "Traceback" not in output
