"""The chunk index in Qdrant: embedded (a folder in the data dir) by default, a server when
RAGLINE_QDRANT_URL is set.

Retrieval is hybrid: e5 dense vectors (searched once per language group) and a BM25-style sparse
index, fused by weighted reciprocal rank. Each tenant's collection has a version, bumped by every
write that changes what a search finds, which keys the answer cache.

The embedded store is a single-process database, so only the worker of role `vector` (or `all`) opens
it; the API and the other roles reach it through activities on the vector queue (temporal/queues.py).
With a Qdrant server every role could, but the policy file still routes store work to the vector queue.
A second process gets `StoreUnavailableError` with a message saying what to do.

Tenants share a Qdrant collection per Ragline collection name: every point carries a `tenant` payload
field and every search, count and delete filters on it (there is no method without a tenant). Point
ids come from document ids, which are derived per tenant, so two tenants never share a point.
"""

from __future__ import annotations

import secrets
import threading
import time
import uuid
from dataclasses import dataclass

from qdrant_client import QdrantClient, models

from ragline import lexical
from ragline.errors import InputError, StoreUnavailableError
from ragline.settings import Settings

_POINT_NAMESPACE = uuid.UUID("5b0f8a52-58f4-4e0e-9a0a-6d2a4c1f7e11")


def point_id(document_id: str, chunk_index: int) -> str:
    """Deterministic: re-running an index step overwrites the same points instead of adding copies."""
    return str(uuid.uuid5(_POINT_NAMESPACE, f"{document_id}:{chunk_index}"))


COLLECTION_PREFIX = "ragline_"


def qdrant_collection(collection: str) -> str:
    return f"{COLLECTION_PREFIX}{collection}"


DENSE = "dense"
LEXICAL = "lexical"
# One point per collection holds its version, changed by every write (upload, prune): answers
# cached for a collection are valid for one version only. (`ragline__meta` can't clash: collection
# names do not start with an underscore, models/jobs.py.)
META_COLLECTION = "ragline__meta"
# Hybrid retrieval: candidates per list, the RRF constant and the weight of each list. The dense side
# runs once per language group, so a passage in another language than the question competes with its
# own language's passages (e5-small scores same-language pairs higher whatever they say).
CANDIDATES = 30
RRF_K = 2
DENSE_WEIGHT = 1.0
LEXICAL_WEIGHT = 0.3
LANGUAGES = ("en", "zh")
# Chunks are written marked pending and found by no search until their document's last step publishes
# them: a document is found whole or not at all (not the first batches of one still being indexed, or
# parked for an operator). Points written before the mark existed have no such field: always found.
PENDING = "pending"
# When a point was last written (time.time()). A removal takes what was there when it was confirmed: an
# upload that reached the document after that (queued for its tenant's slot before the DELETE) keeps its
# chunks.
WRITTEN_AT = "written_at"
_PENDING = models.FieldCondition(key=PENDING, match=models.MatchValue(value=True))


@dataclass
class ChunkPoint:
    document_id: str
    chunk_index: int
    vector: list[float]
    payload: dict


@dataclass
class Hit:
    score: float            # the fused rank score (hybrid) or the cosine (dense-only collections)
    payload: dict
    cosine: float = 0.0     # cosine similarity of the query and the passage (e5)
    vector: list[float] | None = None  # the passage's dense vector (its hubness, ragline/relevance.py)


class VectorIndex:
    def __init__(self, client: QdrantClient, dim: int, *, embedded: bool) -> None:
        self.client = client
        self.dim = dim
        self.embedded = embedded
        # The embedded store is plain Python over SQLite: serialise access from activity threads.
        self._lock = threading.RLock() if embedded else _NoLock()
        self._known: set[str] = set()
        self._layouts: dict[str, bool] = {}
        self._shared: dict[tuple[str, str], bool] = {}  # (collection, tenant): another tenant has passages there
        self._pending: dict[tuple[str, str], bool] = {}  # (collection, tenant): some of its chunks are pending
        # A tenant's quota check and the write it allows are one step per process (on a server too). The
        # documents it let in that have no first chunk yet (a later batch came first) still count.
        self._quota_lock = threading.Lock()
        self._admitted: dict[str, set[tuple[str, str]]] = {}  # tenant -> {(qdrant collection, document id)}

    def _ensure_collection(self, collection: str) -> str:
        name = qdrant_collection(collection)
        if name in self._known:
            return name
        if not self.client.collection_exists(name):
            try:
                self.client.create_collection(
                    name, vectors_config={DENSE: models.VectorParams(size=self.dim, distance=models.Distance.COSINE)},
                    sparse_vectors_config={LEXICAL: models.SparseVectorParams(modifier=models.Modifier.IDF)})
            except Exception:
                if not self.client.collection_exists(name):  # lost a creation race: fine
                    raise
            if self.embedded:
                pass  # the embedded store scans payloads; indexes exist only on a Qdrant server
            else:
                self.client.create_payload_index(name, "tenant", models.KeywordIndexParams(
                    type=models.KeywordIndexType.KEYWORD, is_tenant=True))
                for field in ("document_id", "collection", "lang"):
                    self.client.create_payload_index(name, field, models.PayloadSchemaType.KEYWORD)
        if not self.embedded:  # also on a collection made before the mark: every search filters on it
            self.client.create_payload_index(name, PENDING, models.PayloadSchemaType.BOOL)
        self._known.add(name)
        return name

    def _own_rarity_needed(self, name: str, tenant: str) -> bool:
        """Another tenant has passages in the collection, or this tenant has chunks still pending: a term's
        rarity must then be counted over the tenant's own searchable passages. Embedded, that count is a pass
        in Python over every passage of the tenant (a fifth more time for a search of 5,000 passages), so it
        is done only then; this process is the only writer, so both facts are asked once and kept (a write of
        another tenant's, or a pending write, makes them true; a publish or a removal asks again). A server
        counts it in its index: always."""
        if not self.embedded:
            return True
        key = (name, tenant)
        if key not in self._shared:
            others = models.Filter(must_not=[_tenant(tenant)])
            self._shared[key] = self.client.count(name, count_filter=others, exact=True).count > 0
        if key not in self._pending:
            pending = models.Filter(must=[_tenant(tenant), _PENDING])
            self._pending[key] = self.client.count(name, count_filter=pending, exact=True).count > 0
        return self._shared[key] or self._pending[key]

    def _hybrid(self, name: str) -> bool:
        """Collections made before hybrid retrieval have one unnamed dense vector: searched dense-only
        until their documents are uploaded again into a new collection."""
        if name not in self._layouts:
            vectors = self.client.get_collection(name).config.params.vectors
            self._layouts[name] = isinstance(vectors, dict) and DENSE in vectors
        return self._layouts[name]

    def _point(self, name: str, tenant: str, p: ChunkPoint, *, pending: bool = True,
               written_at: float) -> models.PointStruct:
        text = p.payload.get("text", "")
        payload = {**p.payload, "tenant": tenant, "lang": lexical.language(text), WRITTEN_AT: written_at}
        if pending:
            payload[PENDING] = True
        if not self._hybrid(name):
            return models.PointStruct(id=point_id(p.document_id, p.chunk_index), vector=p.vector, payload=payload)
        ids, values = lexical.document_vector(text)
        return models.PointStruct(id=point_id(p.document_id, p.chunk_index), payload=payload, vector={
            DENSE: p.vector, LEXICAL: models.SparseVector(indices=ids, values=values)})

    def upsert(self, tenant: str, collection: str, points: list[ChunkPoint], *,
               max_documents: int | None = None) -> int:
        """Writes chunks pending: no search finds them before `publish` (so no cached answer is stale). A
        chunk already published stays found: the same document indexed again (the same bytes, once its
        ingestion job has passed the retention) is not hidden while it is. With `max_documents`, the first
        chunks of a document the tenant does not hold yet are refused (InputError) once it holds that many."""
        if max_documents is None or not points:
            return self._upsert(tenant, collection, points)
        with self._quota_lock:
            self._admit(tenant, collection, points[0].document_id, max_documents)
            return self._upsert(tenant, collection, points)

    def _admit(self, tenant: str, collection: str, document_id: str, max_documents: int) -> None:
        with self._lock:
            name = self._ensure_collection(collection)
            if self._holds(name, tenant, document_id):
                return
            held = self.documents_held(tenant)
            if held >= max_documents:
                raise InputError(f"over the tenant's document quota: it holds {held} documents (max_documents = "
                                 f"{max_documents}); remove some (DELETE /v1/documents/{{document_id}}) or ask an "
                                 "operator for a higher max_documents, then upload this file again")
            self._admitted.setdefault(tenant, set()).add((name, document_id))

    def _holds(self, name: str, tenant: str, document_id: str) -> bool:
        mine = models.Filter(must=[_tenant(tenant), _document(document_id)])
        return self.client.count(name, count_filter=mine, exact=True).count > 0

    def documents_held(self, tenant: str) -> int:
        """The tenant's documents over all its collections (indexed, or on their way: pending chunks)."""
        with self._lock:
            first_chunks = models.Filter(must=[_tenant(tenant), models.FieldCondition(
                key="chunk", match=models.MatchValue(value=0))])
            held: set[tuple[str, str]] = set()
            for c in self.client.get_collections().collections:
                if c.name.startswith(COLLECTION_PREFIX) and c.name != META_COLLECTION:
                    offset = None
                    while True:
                        batch, offset = self.client.scroll(c.name, scroll_filter=first_chunks, limit=1000,
                                                           offset=offset, with_payload=["document_id"])
                        held |= {(c.name, (p.payload or {}).get("document_id")) for p in batch}
                        if offset is None:
                            break
            # Let in here with its first chunk not written yet: counted while any chunk of it is there.
            admitted = self._admitted.setdefault(tenant, set())
            admitted -= held
            admitted -= {(name, doc) for name, doc in admitted if not self._holds(name, tenant, doc)}
            return len(held) + len(admitted)

    def _upsert(self, tenant: str, collection: str, points: list[ChunkPoint]) -> int:
        with self._lock:
            name = self._ensure_collection(collection)
            ids = [point_id(p.document_id, p.chunk_index) for p in points]
            found = {str(r.id) for r in self.client.retrieve(name, ids=ids, with_payload=[PENDING])
                     if not (r.payload or {}).get(PENDING)}
            now = time.time()
            for collection_, tenant_ in self._shared:
                if collection_ == name and tenant_ != tenant:
                    self._shared[(collection_, tenant_)] = True
            self.client.upsert(name, wait=True, points=[
                self._point(name, tenant, p, pending=i not in found, written_at=now) for p, i in zip(points, ids)])
            if len(found) < len(ids):
                self._pending[(name, tenant)] = True
        return len(points)

    def publish(self, tenant: str, collection: str, document_id: str, chunks: int) -> None:
        """A document's chunks as indexed now become what searches find: the ones beyond `chunks` (left by an
        older chunking) go, the pending ones are published, and the collection's cached answers go."""
        with self._lock:
            name = self._ensure_collection(collection)
            mine = [_tenant(tenant),
                    _document(document_id)]
            try:
                self.client.delete(name, wait=True, points_selector=models.FilterSelector(filter=models.Filter(
                    must=[*mine, models.FieldCondition(key="chunk", range=models.Range(gte=chunks))])))
                self.client.delete_payload(name, keys=[PENDING], wait=True, points=models.FilterSelector(
                    filter=models.Filter(must=[*mine, _PENDING])))
            finally:  # a delete that went through changed what searches find, even if the next call failed
                self._pending.pop((name, tenant), None)
                self._bump(tenant, collection)

    # -- the collection's version (per tenant) -----------------------------------------------------
    def _meta(self) -> str:
        if META_COLLECTION not in self._known:
            if not self.client.collection_exists(META_COLLECTION):
                try:
                    self.client.create_collection(META_COLLECTION, vectors_config=models.VectorParams(
                        size=1, distance=models.Distance.DOT))
                except Exception:
                    if not self.client.collection_exists(META_COLLECTION):
                        raise
            self._known.add(META_COLLECTION)
        return META_COLLECTION

    def version(self, tenant: str, collection: str) -> int:
        """Changes with every write to the tenant's collection (0: never written)."""
        with self._lock:
            found = self.client.retrieve(self._meta(), ids=[_meta_id(tenant, collection)], with_payload=True)
        return int(found[0].payload.get("version", 0)) if found else 0

    def _bump(self, tenant: str, collection: str) -> None:
        # A fresh random version, not the last one plus one: two workers writing to one Qdrant server
        # at once could both read v and write v+1, and an answer cached between them would outlive
        # the second write.
        version = secrets.randbits(62) + 1
        self.client.upsert(self._meta(), wait=True, points=[models.PointStruct(
            id=_meta_id(tenant, collection), vector=[1.0],
            payload={"tenant": tenant, "collection": collection, "version": version})])

    def prune(self, tenant: str, collection: str, document_id: str, keep_chunks: int,
              written_before: float | None = None) -> None:
        """Remove points of a document from chunk `keep_chunks` on (0: all of them); with `written_before`
        (a time.time()), only the ones written before it (points written before the stamp existed count as
        written before)."""
        later = [models.FieldCondition(key=WRITTEN_AT, range=models.Range(gte=written_before))] \
            if written_before is not None else None
        with self._lock:
            name = self._ensure_collection(collection)
            self.client.delete(name, wait=True, points_selector=models.FilterSelector(filter=models.Filter(
                must=[_tenant(tenant),
                      _document(document_id),
                      models.FieldCondition(key="chunk", range=models.Range(gte=keep_chunks))],
                must_not=later)))
            self._pending.pop((name, tenant), None)
            self._bump(tenant, collection)

    def remove_pending(self, tenant: str, collection: str, document_id: str) -> None:
        """Remove a document's chunks that no search finds yet (written, never published)."""
        with self._lock:
            name = self._ensure_collection(collection)
            self.client.delete(name, wait=True, points_selector=models.FilterSelector(filter=models.Filter(
                must=[_tenant(tenant), _PENDING,
                      _document(document_id)])))
            self._pending.pop((name, tenant), None)

    def count(self, tenant: str, collection: str, document_id: str | None = None, *, searchable: bool = False) -> int:
        """The tenant's chunks in a collection (of one document): all of them, or only the ones searches find."""
        with self._lock:
            name = qdrant_collection(collection)
            if not self.client.collection_exists(name):
                return 0
            must = [_tenant(tenant)]
            if document_id:
                must.append(_document(document_id))
            found = models.Filter(must=must, must_not=[_PENDING] if searchable else None)
            return self.client.count(name, count_filter=found, exact=True).count

    def has_document(self, tenant: str, collection: str, name: str) -> bool:
        """Whether the tenant has a searchable document in the collection with this id or file name."""
        with self._lock:
            found = qdrant_collection(collection)
            if not self.client.collection_exists(found):
                return False
            named = models.Filter(must=[_tenant(tenant)], must_not=[_PENDING], should=[
                _document(name), models.FieldCondition(key="filename", match=models.MatchValue(value=name))])
            return self.client.count(found, count_filter=named, exact=True).count > 0

    def search(self, tenant: str, collection: str, vector: list[float], top_k: int,
               text: str | None = None) -> list[Hit]:
        """The tenant's top_k passages for a query: hybrid (dense per language group + BM25, fused by
        weighted reciprocal rank) when the query's text is given and the collection has the hybrid
        layout, else dense only."""
        with self._lock:
            name = qdrant_collection(collection)
            if not self.client.collection_exists(name):
                return []
            mine = _tenant(tenant)
            found = models.Filter(must=[mine], must_not=[_PENDING])
            if text is None or not self._hybrid(name):
                using = DENSE if self._hybrid(name) else None
                result = self.client.query_points(name, query=vector, using=using, limit=top_k, with_payload=True,
                                                  with_vectors=[using] if using else True,
                                                  query_filter=found)
                return [Hit(score=p.score, payload=p.payload or {}, cosine=p.score, vector=_dense(p))
                        for p in result.points]
            ids, values = lexical.query_vector(text)
            # The dense lists' points come without vectors: only the fused best need one (their hubness,
            # ragline/relevance.py), fetched below, where a server would send every candidate's.
            requests = [models.QueryRequest(
                query=vector, using=DENSE, limit=CANDIDATES, with_payload=True,
                filter=models.Filter(must_not=[_PENDING], must=[
                    mine, models.FieldCondition(key="lang", match=models.MatchValue(value=lang))]))
                for lang in LANGUAGES]
            weights = [DENSE_WEIGHT] * len(LANGUAGES)
            if ids:
                # IDF over the tenant's own searchable passages: another tenant's uploads (or chunks still
                # pending) would change which of this tenant's passages a term ranks first.
                own_idf = models.SearchParams(idf=models.IdfCorpusParams(corpus=found)) \
                    if self._own_rarity_needed(name, tenant) else None
                requests.append(models.QueryRequest(query=models.SparseVector(indices=ids, values=values),
                                                    using=LEXICAL, limit=CANDIDATES, with_payload=True,
                                                    with_vector=[DENSE], filter=found, params=own_idf))
                weights.append(LEXICAL_WEIGHT)
            responses = self.client.query_batch_points(name, requests=requests)
            fused: dict[str, float] = {}
            points: dict[str, models.ScoredPoint] = {}
            cosines: dict[str, float] = {}
            vectors: dict[str, list[float]] = {}
            for i, (response, weight) in enumerate(zip(responses, weights)):
                for rank, p in enumerate(response.points):
                    key = str(p.id)
                    fused[key] = fused.get(key, 0.0) + weight / (RRF_K + rank + 1)
                    points.setdefault(key, p)
                    if i < len(LANGUAGES):
                        cosines[key] = p.score
                    elif (v := _dense(p)) is not None:
                        vectors[key] = v
                        if key not in cosines:
                            cosines[key] = sum(a * b for a, b in zip(vector, v)) / (_norm(vector) * _norm(v) or 1.0)
            best = sorted(fused, key=lambda k: -fused[k])[:top_k]
            if missing := [points[k].id for k in best if k not in vectors]:
                for record in self.client.retrieve(name, ids=missing, with_payload=False, with_vectors=[DENSE]):
                    vectors[str(record.id)] = _dense(record)
        return [Hit(score=fused[k], payload=points[k].payload or {}, cosine=cosines.get(k, 0.0),
                    vector=vectors.get(k)) for k in best]

    def close(self) -> None:
        with self._lock:
            self.client.close()


def _document(document_id: str) -> models.FieldCondition:
    return models.FieldCondition(key="document_id", match=models.MatchValue(value=document_id))


def _tenant(tenant: str) -> models.FieldCondition:
    if not tenant:
        raise ValueError("every vector store call names its tenant")
    return models.FieldCondition(key="tenant", match=models.MatchValue(value=tenant))


def _meta_id(tenant: str, collection: str) -> str:
    return str(uuid.uuid5(_POINT_NAMESPACE, f"meta:{tenant}:{collection}"))


def _dense(point: models.ScoredPoint | models.Record) -> list[float] | None:
    """A point's dense vector: named in hybrid collections, the only one in older dense-only ones."""
    v = point.vector
    return v.get(DENSE) if isinstance(v, dict) else v


def _norm(v: list[float]) -> float:
    return sum(x * x for x in v) ** 0.5


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
