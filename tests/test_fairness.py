"""Tenants share the task queues fairly: the server hands out waiting tasks in turn among tenants (each
job's fairness key is its tenant), so one tenant's large upload does not hold up another tenant's
small one sent just after it, as first come first served would. A tenant may be given a larger share
(`fairness_weight` in the keys file)."""

from __future__ import annotations

import uuid

import httpx

from models.chat import session_workflow_id
from models.tenancy import scoped
from ragline import keys as api_keys
from temporal import search_attributes as sa
from tests.conftest import running_stack
from tests.helpers import eventually

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


async def test_a_tenants_fairness_weight_goes_with_every_job_it_starts(stack):
    """`[tenants.<name>] fairness_weight` in the keys file: every job the tenant starts carries it with its
    fairness key, and so do the jobs those start (a chat turn's job, an upload's documents); a tenant
    without one gets the server's default weight (1)."""
    tenant = f"weighted-{uuid.uuid4().hex[:8]}"
    path = stack.settings.effective_api_keys_file
    key = api_keys.create(path, tenant, "reviewer", f"{tenant}-reviewer")
    with path.open("a") as f:
        f.write(f"\n[tenants.{tenant}]\nfairness_weight = 3\n")
    collection = f"weighted-{uuid.uuid4().hex[:8]}"
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60,
                                 headers={"Authorization": f"Bearer {key}"}) as http:
        r = await http.post("/v1/documents", data={"collection": collection},
                            files=[("files", ("dues.txt", b"The harbour dues of berth 4 were paid in May."))])
        assert r.status_code == 202, r.text
        upload = r.json()["job_id"]
        r = await http.post("/v1/chats", json={"message": "Were the dues paid?", "collection": collection})
        assert r.status_code == 202, r.text
        turn, session = r.json()["job_id"], r.json()["session_id"]
        ended = {job_id: await eventually(lambda: _ended(http, job_id), what=f"{job_id} ended")
                 for job_id in (upload, turn)}
        assert {job["status"] for job in ended.values()} == {"completed"}, ended
    # The upload's result names its documents' jobs (the listing, from visibility, may not show them yet).
    documents = ended[upload]["result"]["documents"]
    client = stack.client
    started = [upload, turn, session_workflow_id(tenant, session), *(d["job_id"] for d in documents)]
    assert len(started) == 4, started  # the upload, the turn, its session and the one document
    for workflow_id in started:
        priority = (await client.get_workflow_handle(scoped(tenant, workflow_id)).describe()
                    ).raw_description.workflow_execution_info.priority
        assert (priority.fairness_key, priority.fairness_weight) == (tenant, 3), workflow_id
    # A tenant with no weight in the keys file: the server's default.
    accepted = await stack.chat("Were the dues paid?", collection=collection)
    await stack.wait_done(accepted["job_id"])
    priority = (await client.get_workflow_handle(scoped("acme", accepted["job_id"])).describe()
                ).raw_description.workflow_execution_info.priority
    assert (priority.fairness_key, priority.fairness_weight) == ("acme", 0)


async def _ended(http: httpx.AsyncClient, job_id: str) -> dict | None:
    job = (await http.get(f"/v1/jobs/{job_id}")).json()
    return job if job["status"] in ("completed", "failed") else None


async def test_a_sessions_later_turn_runs_with_the_weight_its_tenant_has_now(stack):
    """A session keeps the weight it started with; each turn's job takes its tenant's weight as of the turn."""
    tenant = f"reweighted-{uuid.uuid4().hex[:8]}"
    path = stack.settings.effective_api_keys_file
    key = api_keys.create(path, tenant, "reviewer", f"{tenant}-reviewer")
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60,
                                 headers={"Authorization": f"Bearer {key}"}) as http:
        async def turn(message: str, session: str | None = None) -> dict:
            r = await http.post("/v1/chats", json={"message": message, "collection": f"weights-{tenant}",
                                                   **({"session_id": session} if session else {})})
            assert r.status_code == 202, r.text
            accepted = r.json()
            assert (await eventually(lambda: _ended(http, accepted["job_id"]), what="turn ended"))["status"] == "completed"
            return accepted

        first = await turn("Were the dues paid?")
        with path.open("a") as f:
            f.write(f"\n[tenants.{tenant}]\nfairness_weight = 2\n")
        second = await turn("And when?", first["session_id"])

    async def weight(workflow_id: str) -> float:
        described = await stack.client.get_workflow_handle(scoped(tenant, workflow_id)).describe()
        return described.raw_description.workflow_execution_info.priority.fairness_weight
    assert await weight(session_workflow_id(tenant, first["session_id"])) == 0  # started without one
    assert (await weight(first["job_id"]), await weight(second["job_id"])) == (0, 2)


async def test_a_search_runs_with_its_tenants_fair_share(stack):
    """POST /v1/search starts a workflow on the vector queue, which indexing shares: it carries its tenant's
    fairness key and weight like every other job, so one tenant's searches take their turn there."""
    tenant = f"searcher-{uuid.uuid4().hex[:8]}"
    path = stack.settings.effective_api_keys_file
    key = api_keys.create(path, tenant, "member", f"{tenant}-member")
    with path.open("a") as f:
        f.write(f"\n[tenants.{tenant}]\nfairness_weight = 3\n")
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60,
                                 headers={"Authorization": f"Bearer {key}"}) as http:
        r = await http.post("/v1/search", json={"query": "harbour dues", "collection": f"search-{tenant}"})
        assert r.status_code == 200, r.text

    async def started() -> list:  # the search's id is not returned: found by its tenant (visibility lags)
        query = f"WorkflowType = 'SearchWorkflow' AND {sa.TENANT.name} = '{tenant}'"
        return [w async for w in stack.client.list_workflows(query)]
    [search] = await eventually(started, what="the search in the visibility store")
    priority = (await stack.client.get_workflow_handle(search.id).describe()
                ).raw_description.workflow_execution_info.priority
    assert (priority.fairness_key, priority.fairness_weight) == (tenant, 3)
