"""The chunk index in Qdrant: embedded (a folder in the data dir) by default, a server when
RAGLINE_QDRANT_URL is set.

The embedded store is a single-process database, so only the worker of role `vector` (or `all`) opens
it; the API and the other roles reach it through activities on the vector queue (temporal/queues.py).
With a Qdrant server every role could, but the policy file still routes store work to the vector queue.
A second process gets `StoreUnavailableError` with a message saying what to do.

Tenants share a Qdrant collection per Ragline collection name: every point carries a `tenant` payload
field and every search, count and delete filters on it (there is no method without a tenant). Point
ids come from document ids, which are derived per tenant, so two tenants never share a point.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass

from qdrant_client import QdrantClient, models

from ragline.errors import StoreUnavailableError
from ragline.settings import Settings

_POINT_NAMESPACE = uuid.UUID("5b0f8a52-58f4-4e0e-9a0a-6d2a4c1f7e11")


def point_id(document_id: str, chunk_index: int) -> str:
    """Deterministic: re-running an index step overwrites the same points instead of adding copies."""
    return str(uuid.uuid5(_POINT_NAMESPACE, f"{document_id}:{chunk_index}"))


def qdrant_collection(collection: str) -> str:
    return f"ragline_{collection}"


@dataclass
class ChunkPoint:
    document_id: str
    chunk_index: int
    vector: list[float]
    payload: dict


@dataclass
class Hit:
    score: float
    payload: dict


class VectorIndex:
    def __init__(self, client: QdrantClient, dim: int, *, embedded: bool) -> None:
        self.client = client
        self.dim = dim
        self.embedded = embedded
        # The embedded store is plain Python over SQLite: serialise access from activity threads.
        self._lock = threading.RLock() if embedded else _NoLock()
        self._known: set[str] = set()

    def _ensure_collection(self, collection: str) -> str:
        name = qdrant_collection(collection)
        if name in self._known:
            return name
        if not self.client.collection_exists(name):
            try:
                self.client.create_collection(
                    name, vectors_config=models.VectorParams(size=self.dim, distance=models.Distance.COSINE))
            except Exception:
                if not self.client.collection_exists(name):  # lost a creation race: fine
                    raise
            if self.embedded:
                pass  # the embedded store scans payloads; indexes exist only on a Qdrant server
            else:
                self.client.create_payload_index(name, "tenant", models.KeywordIndexParams(
                    type=models.KeywordIndexType.KEYWORD, is_tenant=True))
                for field in ("document_id", "collection"):
                    self.client.create_payload_index(name, field, models.PayloadSchemaType.KEYWORD)
        self._known.add(name)
        return name

    def upsert(self, tenant: str, collection: str, points: list[ChunkPoint]) -> int:
        with self._lock:
            name = self._ensure_collection(collection)
            self.client.upsert(name, wait=True, points=[
                models.PointStruct(id=point_id(p.document_id, p.chunk_index), vector=p.vector,
                                   payload={**p.payload, "tenant": tenant})
                for p in points
            ])
        return len(points)

    def prune(self, tenant: str, collection: str, document_id: str, keep_chunks: int) -> None:
        """Remove points of a document beyond its current chunk count (left by an older chunking)."""
        with self._lock:
            name = self._ensure_collection(collection)
            self.client.delete(name, wait=True, points_selector=models.FilterSelector(filter=models.Filter(
                must=[_tenant(tenant),
                      models.FieldCondition(key="document_id", match=models.MatchValue(value=document_id)),
                      models.FieldCondition(key="chunk", range=models.Range(gte=keep_chunks))])))

    def count(self, tenant: str, collection: str, document_id: str | None = None) -> int:
        with self._lock:
            name = qdrant_collection(collection)
            if not self.client.collection_exists(name):
                return 0
            must = [_tenant(tenant)]
            if document_id:
                must.append(models.FieldCondition(key="document_id", match=models.MatchValue(value=document_id)))
            return self.client.count(name, count_filter=models.Filter(must=must), exact=True).count

    def search(self, tenant: str, collection: str, vector: list[float], top_k: int) -> list[Hit]:
        with self._lock:
            name = qdrant_collection(collection)
            if not self.client.collection_exists(name):
                return []
            result = self.client.query_points(name, query=vector, limit=top_k, with_payload=True,
                                              query_filter=models.Filter(must=[_tenant(tenant)]))
        return [Hit(score=p.score, payload=p.payload or {}) for p in result.points]

    def close(self) -> None:
        with self._lock:
            self.client.close()


def _tenant(tenant: str) -> models.FieldCondition:
    if not tenant:
        raise ValueError("every vector store call names its tenant")
    return models.FieldCondition(key="tenant", match=models.MatchValue(value=tenant))


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def open_index(settings: Settings) -> VectorIndex:
    if settings.qdrant_url:
        # No request at construction (check_compatibility off): a worker starts while Qdrant is still
        # coming up, and the first store activity retries until it answers.
        client = QdrantClient(url=settings.qdrant_url, api_key=settings.qdrant_api_key, timeout=30,
                              check_compatibility=False)
        return VectorIndex(client, settings.embeddings_dim, embedded=False)
    path = settings.qdrant_path
    path.mkdir(parents=True, exist_ok=True)
    try:
        client = QdrantClient(path=str(path))
    except RuntimeError as exc:
        if "already accessed" in str(exc):
            raise StoreUnavailableError(
                f"the embedded Qdrant store at {path} is already open in another process "
                "(another Ragline worker of role vector or all on the same RAGLINE_DATA_DIR?). Only one process "
                "can open it: stop the other worker, use another RAGLINE_DATA_DIR, or set RAGLINE_QDRANT_URL "
                "to a Qdrant server."
            ) from None
        raise
    return VectorIndex(client, settings.embeddings_dim, embedded=True)
