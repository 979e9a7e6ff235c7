"""Retrieval: embed a query and search the collection."""

from __future__ import annotations

from temporalio import activity

from models.ingest import SearchHit, SearchInput, SearchOutput
from ragline.embeddings import Embedder
from ragline.vectorstore import VectorIndex
from temporal.errors import translate_errors


def find_passages(embedder: Embedder, index: VectorIndex, tenant: str, collection: str, query: str,
                  top_k: int) -> list[SearchHit]:
    """Embed the query and return the tenant's nearest chunks in the collection: the one retrieval
    every feature uses."""
    hits = index.search(tenant, collection, embedder.query(query), top_k)
    return [SearchHit(text=h.payload.get("text", ""), document_id=h.payload.get("document_id", ""),
                      filename=h.payload.get("filename", ""), page=int(h.payload.get("page", 0)),
                      chunk=int(h.payload.get("chunk", 0)), score=float(h.score))
            for h in hits]


class SearchActivities:
    def __init__(self, embedder: Embedder, index: VectorIndex) -> None:
        self.embedder = embedder
        self.index = index

    @activity.defn
    @translate_errors
    def search_chunks(self, req: SearchInput) -> SearchOutput:
        return SearchOutput(hits=find_passages(self.embedder, self.index, req.tenant, req.collection, req.query, req.top_k))

    def all(self) -> list:
        return [self.search_chunks]
