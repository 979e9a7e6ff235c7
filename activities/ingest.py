"""Ingestion activities: extract text -> chunk -> embed (batches) -> index, plus pruning."""

from __future__ import annotations

import time

import numpy as np
from temporalio import activity

from activities.heartbeats import heartbeating_in_thread
from models.ingest import (
    ChunkInput, ChunkOutput, EmbedInput, EmbedOutput, ExtractInput, ExtractOutput, IndexInput, IndexOutput,
    PruneInput, PruneOutput, RemoveInput,
)
from ragline import metrics, text
from ragline.blobstore import BlobStore
from ragline.embeddings import Embedder
from ragline.errors import InputError
from ragline.settings import Settings
from ragline.vectorstore import ChunkPoint, VectorIndex
from temporal.errors import translate_errors


def _attempt() -> int:
    return activity.info().attempt


# A document's workflow records ~13 history events per batch of chunks (embed, index and their bookkeeping)
# and Temporal ends a workflow past 51,200: at this many batches a text is refused as too long, where it was
# embedded for hours and then terminated, its chunks left pending in the index.
MAX_EMBED_BATCHES = 3000


class IngestActivities:
    def __init__(self, settings: Settings, blobs: BlobStore, embedder: Embedder, index: VectorIndex) -> None:
        self.settings = settings
        self.blobs = blobs
        self.embedder = embedder
        self.index = index

    @activity.defn
    @translate_errors
    def extract_text(self, req: ExtractInput) -> ExtractOutput:
        data = self.blobs.get(req.blob_ref)
        pages = text.extract_pages(
            data, req.kind, password=req.password, max_pages=min(req.max_pages or self.settings.max_pages,
                                                                 self.settings.max_pages),
            on_page=lambda done, total: activity.heartbeat({"page": done, "pages": total}))
        text.check_has_text(pages, self.settings.min_text_chars)
        pages_ref = self.blobs.put_json([{"page": p.number, "text": p.text} for p in pages])
        return ExtractOutput(pages_ref=pages_ref, pages=len(pages), chars=sum(len(p.text) for p in pages),
                             attempt=_attempt())

    @activity.defn
    @translate_errors
    def chunk_text(self, req: ChunkInput) -> ChunkOutput:
        pages = [text.Page(number=p["page"], text=p["text"]) for p in self.blobs.get_json(req.pages_ref)]
        chunks = text.chunk_pages(pages, size=self.settings.chunk_size, overlap=self.settings.chunk_overlap)
        most = MAX_EMBED_BATCHES * self.settings.embed_batch_size
        if len(chunks) > most:
            raise InputError(f"too much text for one document: {len(chunks)} chunks, at most {most} "
                             f"({self.settings.chunk_size}-character chunks): split the file",
                             details={"chunks": len(chunks), "max_chunks": most})
        chunks_ref = self.blobs.put_json([{"i": c.index, "page": c.page, "text": c.text} for c in chunks])
        return ChunkOutput(chunks_ref=chunks_ref, chunks=len(chunks), batch_size=self.settings.embed_batch_size,
                           parallelism=self.settings.embed_parallelism, attempt=_attempt())

    # Its heartbeats now tell it of a cancel while it runs; a batch takes seconds and writes nothing, so it
    # ends on its own rather than take an exception raised into its thread (which the engine's C code
    # defers to wherever the thread runs Python next).
    @activity.defn(no_thread_cancel_exception=True)
    @translate_errors
    def embed_chunks(self, req: EmbedInput) -> EmbedOutput:
        chunks = self.blobs.get_json(req.chunks_ref)[req.start:req.end]
        activity.heartbeat({"embedding": len(chunks)})
        started = time.monotonic()
        # Waits for the one embedding engine, then runs it: seconds, or more.
        with heartbeating_in_thread({"embedding": len(chunks)}):
            vectors = np.asarray(self.embedder.passages([c["text"] for c in chunks],
                                                        give_up=activity.is_worker_shutdown), dtype=np.float32)
        metrics.passages_embedded(self.embedder.name, len(chunks), time.monotonic() - started)
        return EmbedOutput(vectors_ref=self.blobs.put(vectors.tobytes()), count=len(chunks),
                           model=self.embedder.name, attempt=_attempt())

    @activity.defn
    @translate_errors
    def index_chunks(self, req: IndexInput) -> IndexOutput:
        chunks = self.blobs.get_json(req.chunks_ref)[req.start:req.end]
        vectors = np.frombuffer(self.blobs.get(req.vectors_ref), dtype=np.float32).reshape(len(chunks), -1)
        points = [
            ChunkPoint(document_id=req.document_id, chunk_index=c["i"], vector=v.tolist(), payload={
                "document_id": req.document_id, "filename": req.filename, "collection": req.collection,
                "page": c["page"], "chunk": c["i"], "text": c["text"]})
            for c, v in zip(chunks, vectors)
        ]
        return IndexOutput(points=self.index.upsert(req.tenant, req.collection, points,
                                                    max_documents=req.max_documents), attempt=_attempt())

    # A cancel of the job reaches it through its heartbeats, and the job waits for it to end: raised into its
    # thread, it stopped the store half way through the un-marking, and the undo that follows left a cancelled
    # document found in part. It ends whole; the job then sees it published (workflows/ingest.py).
    @activity.defn(no_thread_cancel_exception=True)
    @translate_errors
    def prune_stale_chunks(self, req: PruneInput) -> PruneOutput:
        """The document's last step: chunks of an older chunking go, and the ones just indexed become
        searchable (index_chunks writes them pending), all of them at once."""
        with heartbeating_in_thread():
            self.index.publish(req.tenant, req.collection, req.document_id, req.keep_chunks)
        return PruneOutput(points=self.index.count(req.tenant, req.collection, req.document_id), attempt=_attempt())

    # Likewise never cut half way by a cancel raised into its thread: the undo of a job cancelled meanwhile
    # left the chunks it had not reached in the index, pending, with nothing to take them any more.
    @activity.defn(no_thread_cancel_exception=True)
    @translate_errors
    def remove_document_chunks(self, req: RemoveInput) -> PruneOutput:
        """Undo the batches a failed ingestion indexed (pending_only), or remove a document on request: nobody
        should find a document that is not there. The collection's version changes with it, so its cached
        answers go too."""
        before = self.index.count(req.tenant, req.collection, req.document_id)
        if before == 0:  # nothing indexed (nor a collection made for a name given by mistake)
            return PruneOutput(points=0, removed=0, attempt=_attempt())
        with heartbeating_in_thread():
            if req.pending_only:
                self.index.remove_pending(req.tenant, req.collection, req.document_id)
            else:
                self.index.prune(req.tenant, req.collection, req.document_id, keep_chunks=0,
                                 written_before=req.written_before)
        left = self.index.count(req.tenant, req.collection, req.document_id)
        return PruneOutput(points=left, removed=before - left, attempt=_attempt())
