"""Tenants share the task queues fairly: the server hands out waiting tasks in turn among tenants (each
job's fairness key is its tenant), so one tenant's large upload does not hold up another tenant's
small one sent just after it, as first come first served would."""

from __future__ import annotations

import uuid

from tests.conftest import running_stack

BIG_UPLOAD = 24


def _doc(name: str, n: int, token: str) -> tuple[str, bytes]:
    return f"{name}-{n}.txt", f"Ledger {n} of {name}: the harbour dues of berth {n} were paid. {token}".encode()


async def test_one_tenants_big_upload_does_not_hold_up_anothers_small_one(temporal_env, scripted_llm, tmp_path):
    tag = uuid.uuid4().hex[:8]
    address = temporal_env.client.service_client.config.target_host
    # One task at a time per queue, so that tasks wait in the queues and their order is the server's pick.
    # Embeddings go to the scripted model, which records the order it was asked in.
    async with running_stack(address, scripted_llm, tmp_path, task_queue=f"fair-{tag}", worker_cpu_concurrency=1,
                             worker_vector_concurrency=1, embeddings_base_url=scripted_llm.base_url,
                             embeddings_model="scripted") as stack:
        with scripted_llm.scope() as llm:
            big = await stack.upload(*(_doc("big", n, llm.token) for n in range(BIG_UPLOAD)), collection=f"big-{tag}")
            # The big upload is under way: its documents' steps wait in the queues, in line for one worker slot.
            await llm.wait_for_calls(1, "embeddings", timeout=60)
            r = await stack.other_http.post("/v1/documents", data={"collection": f"small-{tag}"},
                                            files=[("files", _doc("small", 0, llm.token))])
            assert r.status_code == 202, r.text
            assert (await stack.wait_done(big["job_id"], timeout=300))["status"] == "completed"
            small = (await stack.other_http.get(f"/v1/jobs/{r.json()['job_id']}")).json()
            assert small["status"] == "completed", small
            embedded = [("small" if "Ledger 0 of small" in c.text else "big") for c in llm.calls("embeddings")]
    assert embedded.count("big") == BIG_UPLOAD and embedded.count("small") == 1
    # The small upload's one batch went out among the first, not behind the big upload's batches.
    assert embedded.index("small") < BIG_UPLOAD / 4, embedded
