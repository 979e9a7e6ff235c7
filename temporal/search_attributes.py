"""The project's custom search attributes. Jobs are listed through Temporal visibility with these,
so there is no second database of jobs."""

from __future__ import annotations

from temporalio.common import SearchAttributeKey

JOB_KIND = SearchAttributeKey.for_keyword("RaglineKind")
JOB_STATUS = SearchAttributeKey.for_keyword("RaglineStatus")
COLLECTION = SearchAttributeKey.for_keyword("RaglineCollection")
FILENAME = SearchAttributeKey.for_keyword("RaglineFilename")
DOCUMENT_ID = SearchAttributeKey.for_keyword("RaglineDocumentId")
CHUNKS = SearchAttributeKey.for_int("RaglineChunks")
PAGES = SearchAttributeKey.for_int("RaglinePages")
SESSION = SearchAttributeKey.for_keyword("RaglineSession")
# The tenant a workflow belongs to: on every workflow Ragline starts, in every visibility query.
TENANT = SearchAttributeKey.for_keyword("RaglineTenant")

ALL = (JOB_KIND, JOB_STATUS, COLLECTION, FILENAME, DOCUMENT_ID, CHUNKS, PAGES, SESSION, TENANT)


def cli_flags() -> list[str]:
    """`--search-attribute Name=Type` flags for `temporal server start-dev`."""
    flags: list[str] = []
    for key in ALL:
        type_name = {"KEYWORD": "Keyword", "INT": "Int", "TEXT": "Text", "DOUBLE": "Double",
                     "BOOL": "Bool", "DATETIME": "Datetime", "KEYWORD_LIST": "KeywordList"}[
            key.indexed_value_type.name.removeprefix("INDEXED_VALUE_TYPE_")]
        flags += ["--search-attribute", f"{key.name}={type_name}"]
    return flags


async def ensure_registered(client, namespace: str) -> None:
    """Register any missing attribute on a server we did not start (e.g. one already on 7233)."""
    from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest

    existing = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=namespace))
    known = set(existing.custom_attributes) | set(existing.system_attributes)
    missing = {k.name: k.indexed_value_type for k in ALL if k.name not in known}
    if missing:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(namespace=namespace, search_attributes=missing))
