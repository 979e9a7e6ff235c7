"""Tenants: every workflow id starts with its tenant (`<tenant>.<local id>`) and every workflow carries
the `RaglineTenant` search attribute; every vector in Qdrant carries a `tenant` payload field.

Job ids the API shows are workflow ids, tenant prefix included. A job id a caller sends is always
read inside the caller's own tenant (`scoped`), so another tenant's job can only ever be "not found".
"""

from __future__ import annotations

from pydantic import BaseModel

TENANT_PATTERN = r"^[a-z0-9][a-z0-9-]{0,31}$"
# Inputs built by hand (tests, the CLI) that do not say otherwise belong to this tenant.
DEFAULT_TENANT = "default"


def workflow_id(tenant: str, local_id: str) -> str:
    return f"{tenant}.{local_id}"


def scoped(tenant: str, job_id: str) -> str:
    """The workflow id a caller of `tenant` means by `job_id` (with or without the tenant prefix)."""
    return job_id if job_id.startswith(f"{tenant}.") else workflow_id(tenant, job_id)


def local_id(workflow_id_: str) -> str:
    """The id without its tenant prefix."""
    return workflow_id_.split(".", 1)[1] if "." in workflow_id_ else workflow_id_


# -- running slots: at most N jobs of a tenant run at once (workflows/gate.py) ----------------------

class SlotRequest(BaseModel):
    """A job asks its tenant's gate for a running slot (or gives it back)."""
    tenant: str
    job_id: str
    ticket: int = 1  # which of the job's requests (it asks again after lending its slot)
    limit: int | None = None  # the tenant's cap as the worker reads it now (the gate keeps the latest)
    refusable: bool = False  # the job fails on a refusal (SlotGrant.refused); an older build's would wait for ever


class SlotGrant(BaseModel):
    """The gate's answer to a request, by signal: granted, or the job's place in line."""
    ticket: int = 1
    granted: bool
    running: int
    limit: int
    position: int = 0  # in the line when not granted: 1 is next
    # The gate took no more (MAX_IN_GATE jobs of the tenant run or wait): why. The job fails with it.
    refused: str | None = None


class GateState(BaseModel):
    """The gate's input, and what it carries over continue-as-new."""
    tenant: str
    limit: int
    holders: list[str] = []
    waiting: list[str] = []
    tickets: dict[str, int] = {}  # the request each holder or waiting job is answered for
    owed: list[str] = []  # jobs whose standing changed while the last run was ending: this run tells them
    rotate_after: int = 2000  # continue-as-new past this history length (or when the server suggests it)


class JobIds(BaseModel):
    job_ids: list[str]


class ChildWaiting(BaseModel):
    """A child job tells its parent, by signal, that it started or stopped waiting for a person (or
    that all of its own children did): the job holding the running slot lends it meanwhile."""
    job_id: str
    waiting: bool
    seq: int  # signals may arrive out of order: the higher one wins
