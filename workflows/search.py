"""Search: the API cannot open the embedded Qdrant store (one process per folder), so queries run in
the worker as a local activity behind a short workflow."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.models import SearchInput, SearchOutput
    from temporal import policies


@workflow.defn
class SearchWorkflow:
    @workflow.run
    async def run(self, req: SearchInput) -> SearchOutput:
        return await workflow.execute_local_activity(
            "search_chunks", req, result_type=SearchOutput, **policies.local_options("search_chunks"))
