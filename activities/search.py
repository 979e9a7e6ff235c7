"""Retrieval: embed a query and search the collection."""

from __future__ import annotations

from temporalio import activity

from activities.models import SearchHit, SearchInput, SearchOutput
from ragline.embeddings import Embedder
from ragline.vectorstore import VectorIndex
from temporal.errors import translate_errors


class SearchActivities:
    def __init__(self, embedder: Embedder, index: VectorIndex) -> None:
        self.embedder = embedder
        self.index = index

    @activity.defn(name="search_chunks")
    @translate_errors
    def search_chunks(self, req: SearchInput) -> SearchOutput:
        hits = self.index.search(req.collection, self.embedder.query(req.query), req.top_k)
        return SearchOutput(hits=[
            SearchHit(text=h.payload.get("text", ""), document_id=h.payload.get("document_id", ""),
                      filename=h.payload.get("filename", ""), page=int(h.payload.get("page", 0)),
                      chunk=int(h.payload.get("chunk", 0)), score=float(h.score))
            for h in hits
        ])

    def all(self) -> list:
        return [self.search_chunks]
