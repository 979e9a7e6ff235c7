"""Idempotency-Key: one request, one job, however often it is sent.

A keyed request's job id is derived from the key, so a resend finds the job Temporal recorded the first
time, with no worker in the path and nothing run twice. The job keeps a digest of the request that made
it (memo `request`): the same key sent with another body is refused (422 `idempotency_key_reused`)
rather than answered with a job that does something else. A key is remembered as long as its job's
history is kept (the namespace's retention).
"""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from typing import Annotated, Any

from fastapi import Header
from temporalio.client import Client
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from api.errors import ApiError
from models.jobs import REQUEST_MEMO

IdempotencyKeyDep = Annotated[str | None, Header(
    alias="Idempotency-Key", min_length=1, max_length=200,
    description="Names the request: sent again (a timeout, a retrying client), it returns the same job "
                "and runs nothing twice; with a different body it is refused (422 idempotency_key_reused)")]


def key_digest(key: str, length: int = 16) -> str:
    """The part of a job id a key gives: hex, whatever characters the key has."""
    return hashlib.sha256(key.encode()).hexdigest()[:length]


def request_digest(*parts: Any) -> str:
    """What a request asks for, to tell a resend from another request under the same key."""
    canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def ensure_same_request(key: str, recorded: str | None, digest: str, same: tuple[str, ...] = ()) -> None:
    """A job recorded before digests were kept (`recorded` None) is taken as the same request, and so is one
    recorded under a digest in `same` (the request spelt another way, as an earlier version digested it)."""
    if recorded is not None and recorded != digest and recorded not in same:
        raise ApiError(422, "idempotency_key_reused",
                       f"the Idempotency-Key {key!r} was sent before with a different request; its job answers "
                       "that request only: use a new key for a new request")


def decision_id(action: str, key: str | None, decision: Any) -> str | None:
    """The Update id of a person's keyed decision (review, retry, discard): the same decision sent again
    is the same Update, answered with the first outcome; another decision under the key is a new one,
    which the job judges as it stands."""
    if key is None:
        return None
    return f"{action}-{key_digest(key)}-{request_digest(decision)[:16]}"


async def recorded_request(client: Client, job_id: str, rpc_timeout: timedelta) -> tuple[bool, str | None]:
    """Whether the job exists, and the digest of the request that made it (None when it has none)."""
    try:
        desc = await client.get_workflow_handle(job_id).describe(rpc_timeout=rpc_timeout)
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return False, None
        raise
    return True, (await desc.memo()).get(REQUEST_MEMO)


async def start_once(client: Client, workflow: Any, arg: Any, *, id: str, key: str | None, digest: str,
                     rpc_timeout: timedelta, same: tuple[str, ...] = (), **options: Any) -> bool:
    """Start the job; True when a keyed request was sent before (its job, under the same id, answers it).

    With a key the id is never reused, not even after the job ended: the resend gets the first outcome."""
    if key is None:
        await client.start_workflow(workflow, arg, id=id, rpc_timeout=rpc_timeout, **options)
        return False
    try:
        await client.start_workflow(workflow, arg, id=id, rpc_timeout=rpc_timeout,
                                    id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                                    memo={REQUEST_MEMO: digest}, **options)
        return False
    except WorkflowAlreadyStartedError:
        _, recorded = await recorded_request(client, id, rpc_timeout)
        ensure_same_request(key, recorded, digest, same)
        return True
