"""The worker deployment's current version on a first deploy.

A versioned worker (RAGLINE_WORKER_BUILD_ID) gets no workflow task until its build is the deployment's
current version: on a first deploy nothing is current, and every job would wait, accepted and `queued`,
with pollers on every queue and no alert. The workers that run workflows therefore make their build
current when the deployment has no current version yet. A later build is never made current this way:
switching is the operator's step (README "Rolling out a new build while sessions are open").
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import structlog
from temporalio.api.workflowservice.v1 import (
    DescribeWorkerDeploymentRequest, SetWorkerDeploymentCurrentVersionRequest,
)
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

log = structlog.get_logger(__name__)

# The server refuses a version until its workers have polled (it knows the deployment from their first
# poll): asked again this often, for this long.
RETRY_EVERY = timedelta(seconds=1)
PATIENCE = timedelta(minutes=2)


async def current_build(client: Client, deployment: str) -> tuple[str | None, bytes, bool] | None:
    """The deployment's current build id (None: none), its conflict token, and whether its current version
    was ever set (a deployment with none since then was made unversioned by an operator); None when the server
    does not know the deployment yet."""
    try:
        described = await client.workflow_service.describe_worker_deployment(DescribeWorkerDeploymentRequest(
            namespace=client.namespace, deployment_name=deployment))
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return None
        raise
    routing = described.worker_deployment_info.routing_config
    current = routing.current_deployment_version.build_id if routing.HasField("current_deployment_version") \
        else None
    return current or None, described.conflict_token, routing.HasField("current_version_changed_time")


async def make_first_build_current(client: Client, deployment: str, build_id: str, *,
                                   patience: timedelta = PATIENCE) -> str | None:
    """Makes `build_id` the deployment's current version if it has none; the build that is current then
    (this one, or the one found), or None when the server did not take it within `patience`, or when an
    operator made the deployment unversioned (that stays so until they make a build current)."""
    deadline = time.monotonic() + patience.total_seconds()
    while True:
        try:
            found = await current_build(client, deployment)
            if found is not None and found[0] is not None:
                if found[0] != build_id:
                    log.info("worker deployment has a current version: this build waits to be made current",
                             deployment=deployment, current=found[0], build_id=build_id)
                return found[0]
            if found is not None and found[2]:
                log.warning("worker deployment was made unversioned (set-current-version --unversioned): this "
                            "build is not made current; no versioned job runs until an operator makes a build "
                            "current", deployment=deployment, build_id=build_id)
                return None
            if found is not None:
                await client.workflow_service.set_worker_deployment_current_version(
                    SetWorkerDeploymentCurrentVersionRequest(
                        namespace=client.namespace, deployment_name=deployment, build_id=build_id,
                        conflict_token=found[1], identity=client.identity))
                log.info("worker deployment had no current version: this build is now current",
                         deployment=deployment, build_id=build_id)
                return build_id
        except RPCError as exc:
            said = exc.message
            # Anything but "not polled yet", or "another worker changed it first" (the conflict token), or
            # the server out of reach is not ours to change (a key without the permission, say): said once.
            if exc.status not in _LOOK_AGAIN:
                return _not_made_current(deployment, build_id, said)
        else:
            said = "the deployment is not known yet"
        if time.monotonic() > deadline:
            return _not_made_current(deployment, build_id, said)
        await asyncio.sleep(RETRY_EVERY.total_seconds())


_LOOK_AGAIN = (RPCStatusCode.FAILED_PRECONDITION, RPCStatusCode.NOT_FOUND, RPCStatusCode.ABORTED,
               RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED)


def _not_made_current(deployment: str, build_id: str, said: str) -> None:
    log.warning("could not make this build the worker deployment's current version: no job runs until one is "
                "current (temporal worker deployment set-current-version)",
                deployment=deployment, build_id=build_id, error=said)
