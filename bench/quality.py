"""Retrieval quality on the shipped labelled set, straight against the real components (no Temporal):
`python -m bench.quality [--k 5] [--dump features.json]`.

Indexes bench/eval/docs/* and the shared PDFs the golden set names into a fresh embedded Qdrant with the
real chunker, e5 embeddings and the index, then asks every question of bench/eval/golden.jsonl through
`find_passages`, the one retrieval helper. The same numbers come from `POST /v1/evaluations` on a
running stack (see `python -m bench.quality --api URL`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

EVAL_DIR = Path(__file__).resolve().parent / "eval"
GOLDEN = EVAL_DIR / "golden.jsonl"
DOCS = EVAL_DIR / "docs"
SHARED_PDFS = Path(__file__).resolve().parent.parent.parent / "shared" / "pdfs"
COLLECTION = "eval"
TENANT = "bench"


def corpus_files() -> list[Path]:
    """The documents the golden set is about: our own under eval/docs, plus the shared PDFs it names."""
    from ragline.evaluation import parse_jsonl

    named = {q.expected_document for q in parse_jsonl(GOLDEN.read_text(encoding="utf-8")) if q.expected_document}
    files = sorted(DOCS.iterdir())
    files += [SHARED_PDFS / n for n in sorted(named) if (SHARED_PDFS / n).exists()]
    # Distractors: more shared PDFs no question is about.
    files += [SHARED_PDFS / n for n in ("pdflatex-outline.pdf", "test-orient.pdf") if (SHARED_PDFS / n).exists()]
    return files


def build_index(settings, embedder, index) -> int:  # noqa: ANN001
    from ragline import text
    from ragline.vectorstore import ChunkPoint

    total = 0
    for path in corpus_files():
        data = path.read_bytes()
        kind = "pdf" if path.suffix == ".pdf" else "text"
        pages = text.extract_pages(data, kind)
        chunks = text.chunk_pages(pages, size=settings.chunk_size, overlap=settings.chunk_overlap)
        document_id = hashlib.sha256(data).hexdigest()[:16]
        vectors = embedder.passages([c.text for c in chunks])
        index.upsert(TENANT, COLLECTION, [ChunkPoint(document_id=document_id, chunk_index=c.index, vector=v, payload={
            "document_id": document_id, "filename": path.name, "collection": COLLECTION, "page": c.page,
            "chunk": c.index, "text": c.text}) for c, v in zip(chunks, vectors)])
        total += len(chunks)
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quality")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--dump", type=Path, help="write per-question features (for calibration) here")
    args = parser.parse_args(argv)

    from activities.search import find_passages
    from ragline import evaluation, relevance
    from ragline.embeddings import LocalE5Embedder
    from ragline.settings import Settings
    from ragline.vectorstore import open_index

    questions = evaluation.parse_jsonl(GOLDEN.read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp))
        embedder = LocalE5Embedder()
        index = open_index(settings)
        t0 = time.monotonic()
        chunks = build_index(settings, embedder, index)
        print(f"indexed {chunks} chunks from {len(corpus_files())} documents in {time.monotonic() - t0:.1f} s",
              file=sys.stderr)
        outcomes, dump, times = [], [], []
        for q in questions:
            t = time.monotonic()
            hits = find_passages(embedder, index, TENANT, COLLECTION, q.question, args.k)
            times.append(time.monotonic() - t)
            rank = evaluation.rank_of(q.expected_document, [(h.document_id, h.filename) for h in hits]) \
                if q.expected_document else None
            score = max((h.relevance for h in hits), default=0.0)
            outcomes.append(evaluation.QuestionOutcome(
                question=q.question, expected_document=q.expected_document, rank=rank,
                supported=score >= relevance.threshold(), relevance=score, top=[h.filename for h in hits]))
            dump.append({"question": q.question, "in_corpus": q.in_corpus, "rank": rank,
                         "hits": [h.model_dump(exclude={"text"}) for h in hits]})
        index.close()
    report = evaluation.summarise(COLLECTION, args.k, relevance.threshold(), outcomes)
    print(evaluation.table(report))
    print(f"\nretrieval p50 {np.percentile(times, 50) * 1000:.0f} ms per question", file=sys.stderr)
    for o in outcomes:
        if o.expected_document and (o.rank is None or o.rank > 1):
            print(f"  rank {o.rank}: {o.question} -> {o.top[:3]}", file=sys.stderr)
    if args.dump:
        args.dump.write_text(json.dumps(dump, ensure_ascii=False, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
