"""Search: the API cannot open the embedded Qdrant store (one process per folder), so queries run in
the worker that holds it: this short workflow runs on the vector queue (temporal/queues.py), polled
only by the vector (or all) role, and searches in a local activity there: one workflow task, no
activity round trip, whichever process owns the store."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.search import SearchActivities
    from models.ingest import SearchInput, SearchOutput
    from temporal import policies


@workflow.defn
class SearchWorkflow:
    @workflow.run
    async def run(self, req: SearchInput) -> SearchOutput:
        return await policies.execute_local(SearchActivities.search_chunks, req)
