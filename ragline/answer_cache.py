"""Answers to repeat questions, served without a model call.

Key: (collection, collection version, normalised question). The version lives in the index and changes
on every write to the collection (upload, prune: `VectorIndex.version`), so an upload makes every
cached answer of that collection unreachable at once; nothing has to be purged.

Where it lives: in the process that owns the vector index, next to retrieval (retrieve_context looks it
up in the same activity, so a hit costs no extra round trip, and cache_answer stores into it; both run
where the index is). With the embedded store that is the one process that may open it, so every turn
of a data folder sees the same cache. With a Qdrant server several workers each keep their own LRU;
the version still comes from the shared index, so none of them can serve a stale answer.

Hits and misses are logged and counted (`ragline_answer_cache_lookups_total{result}`, ragline/metrics.py).
"""

from __future__ import annotations

import hashlib
import re
import threading
import unicodedata
from collections import OrderedDict

import structlog

from ragline import metrics

log = structlog.get_logger("ragline.cache")

def record_lookup(hit: bool, collection: str) -> None:
    log.info("answer cache " + ("hit" if hit else "miss"), collection=collection)
    metrics.answer_cache_lookup(hit)


def normalise_question(question: str) -> str:
    text = unicodedata.normalize("NFKC", question).casefold()
    text = re.sub(r"\s+", " ", text).strip()
    return text.rstrip("?？!！.。 ")


def cache_key(tenant: str, collection: str, version: int, question: str, top_k: int) -> str:
    """Scoped to the tenant: two tenants' collections of one name never share an answer. `top_k` is part of
    the question: asked again with more passages, it gets an answer made from them, not the cached one."""
    asked = f"{tenant}\n{collection}\n{version}\n{top_k}\n{normalise_question(question)}"
    digest = hashlib.sha256(asked.encode()).hexdigest()
    return f"{tenant}:{collection}:{version}:{digest[:32]}"


class AnswerCache:
    """A bounded LRU of JSON-ready turn results."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, dict] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> dict | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: str, value: dict) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)
