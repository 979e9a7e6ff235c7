"""Retrieval: embed a query and search the collection."""

from __future__ import annotations

from temporalio import activity

from models.ingest import SearchHit, SearchInput, SearchOutput
from ragline import lexical, prompts, relevance
from ragline.embeddings import Embedder
from ragline.vectorstore import VectorIndex
from temporal.errors import translate_errors


RERANK_CANDIDATES = 10


def candidates(embedder: Embedder, index: VectorIndex, tenant: str, collection: str, query: str,
               limit: int = RERANK_CANDIDATES) -> list[tuple[SearchHit, list[float]]]:
    """The fused candidates for a query in fused order, each with its relevance features (ragline/relevance.py;
    bench.calibrate fits on these) and no relevance yet."""
    found = []
    for h in index.search(tenant, collection, embedder.query(query), limit, text=query):
        text = h.payload.get("text", "")
        found.append((SearchHit(text=text, document_id=h.payload.get("document_id", ""),
                                filename=h.payload.get("filename", ""), page=int(h.payload.get("page", 0)),
                                chunk=int(h.payload.get("chunk", 0)), score=round(float(h.cosine), 4)),
                      relevance.features(query, text, h.cosine, relevance.hubness(embedder, query, h.vector))))
    return found


def find_passages(embedder: Embedder, index: VectorIndex, tenant: str, collection: str, query: str,
                  top_k: int) -> list[SearchHit]:
    """The tenant's best chunks in the collection for a query, best first: the one retrieval every
    feature uses. Hybrid (e5 dense per language group + BM25, fused); each hit has its cosine as `score`
    and its calibrated `relevance` (ragline/relevance.py)."""
    found = []
    for hit, feats in candidates(embedder, index, tenant, collection, query, max(top_k, RERANK_CANDIDATES)):
        hit.relevance = round(relevance.probability(feats), 4)
        found.append(hit)
    # Rerank the fused candidates by calibrated relevance (ties keep the fused order).
    return sorted(found, key=lambda h: -h.relevance)[:top_k]


def find_passages_for_turn(embedder: Embedder, index: VectorIndex, tenant: str, collection: str, question: str,
                           top_k: int, *, threshold: float, follows: str | None = None) -> list[SearchHit]:
    """A chat turn's passages. A follow-up ("and what caused it?") often names its topic only in the
    question before it: when alone it finds nothing relevant and it points back (ragline/lexical.py), it
    is also searched together with that question, and the best of both is kept. A question that changes
    the subject ("what is the capital of Australia?") stays alone, and is refused when nothing covers it."""
    hits = find_passages(embedder, index, tenant, collection, question, top_k)
    if not follows or any(h.relevance >= threshold for h in hits) or not lexical.refers_back(question):
        return hits
    best: dict[tuple[str, int], SearchHit] = {}
    for hit in hits + find_passages(embedder, index, tenant, collection, f"{follows}\n{question}", top_k):
        key = (hit.document_id, hit.chunk)
        if key not in best or hit.relevance > best[key].relevance:
            best[key] = hit
    return sorted(best.values(), key=lambda h: -h.relevance)[:top_k]


def no_documents_warnings(index: VectorIndex, tenant: str, collection: str, hits: list[SearchHit]) -> list[str]:
    """A warning when a search found nothing because the tenant has no documents in the collection (a
    misspelt name, nothing uploaded yet or still being indexed; another tenant's documents do not count).
    The collection is counted only when nothing was found, so a search that finds something pays nothing
    for it."""
    if hits or index.count(tenant, collection, searchable=True) > 0:
        return []
    return [prompts.no_documents_warning(collection)]


class SearchActivities:
    def __init__(self, embedder: Embedder, index: VectorIndex) -> None:
        self.embedder = embedder
        self.index = index

    @activity.defn
    @translate_errors
    def search_chunks(self, req: SearchInput) -> SearchOutput:
        hits = find_passages(self.embedder, self.index, req.tenant, req.collection, req.query, req.top_k)
        return SearchOutput(hits=hits, warnings=no_documents_warnings(self.index, req.tenant, req.collection, hits))
