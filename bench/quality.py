"""Retrieval quality on the shipped labelled sets, straight against the real components (no Temporal):
`python -m bench.quality [--k 5] [--dump features.json]`.

Indexes bench/eval/docs/* and the shared PDFs the sets name into a fresh embedded Qdrant with the real
chunker, e5 embeddings and the index, then asks every question through `find_passages`, the one
retrieval helper. Two sets: bench/eval/golden.jsonl, which `bench.calibrate` fits the relevance gate on,
and bench/eval/holdout.jsonl, which it never sees, so its numbers are out of sample. Each gets the table
`POST /v1/evaluations` reports; a last table splits the gate's decisions by language pair.
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
GOLDEN = EVAL_DIR / "golden.jsonl"    # the relevance gate is fitted on these
HOLDOUT = EVAL_DIR / "holdout.jsonl"  # never seen by the fit
SETS = {"fit (golden.jsonl)": GOLDEN, "held out (holdout.jsonl)": HOLDOUT}
DOCS = EVAL_DIR / "docs"
SHARED_PDFS = Path(__file__).resolve().parent.parent.parent / "shared" / "pdfs"
COLLECTION = "eval"
TENANT = "bench"


def load(path: Path) -> list:
    from ragline.evaluation import parse_jsonl

    return parse_jsonl(path.read_text(encoding="utf-8"))


def corpus_files() -> list[Path]:
    """The documents the sets are about: our own under eval/docs, plus the shared PDFs they name."""
    named = {q.expected_document for path in SETS.values() for q in load(path) if q.expected_document}
    files = sorted(DOCS.iterdir())
    files += [SHARED_PDFS / n for n in sorted(named) if (SHARED_PDFS / n).exists()]
    # Distractors: more shared PDFs no question is about.
    files += [SHARED_PDFS / n for n in ("pdflatex-outline.pdf", "test-orient.pdf") if (SHARED_PDFS / n).exists()]
    return files


def index_documents(settings, embedder, index, paths: list[Path]) -> dict[str, str]:  # noqa: ANN001
    """Chunk, embed and index files (PDF or text) as ingestion does; the language group (en / zh) of each
    file, by its name."""
    from ragline import lexical, text
    from ragline.vectorstore import ChunkPoint

    languages = {}
    for path in paths:
        data = path.read_bytes()
        kind = "pdf" if path.suffix == ".pdf" else "text"
        pages = text.extract_pages(data, kind)
        chunks = text.chunk_pages(pages, size=settings.chunk_size, overlap=settings.chunk_overlap)
        document_id = hashlib.sha256(data).hexdigest()[:16]
        vectors = embedder.passages([c.text for c in chunks])
        index.upsert(TENANT, COLLECTION, [ChunkPoint(document_id=document_id, chunk_index=c.index, vector=v, payload={
            "document_id": document_id, "filename": path.name, "collection": COLLECTION, "page": c.page,
            "chunk": c.index, "text": c.text}) for c, v in zip(chunks, vectors)])
        index.publish(TENANT, COLLECTION, document_id, chunks=len(chunks))
        languages[path.name] = lexical.language("\n".join(p.text for p in pages))
    return languages


def build_index(settings, embedder, index) -> dict[str, str]:  # noqa: ANN001
    """Index the corpus the sets are about."""
    return index_documents(settings, embedder, index, corpus_files())


def gate_by_language(name: str, questions: list, outcomes: list, languages: dict[str, str]) -> str:
    """One row: how the gate decided, by the language of the question and of its document (cross-lingual
    pairs are the hard case for e5-small)."""
    from ragline import lexical

    def share(kind: str, want: bool) -> str:
        decided = [o.supported == want for q, o in zip(questions, outcomes) if pair(q) == kind]
        return f"{sum(decided)}/{len(decided)}" if decided else "-"

    def pair(q) -> str:  # noqa: ANN001
        asked = lexical.language(q.question)
        if not q.in_corpus:
            return f"{asked} out"
        return "same" if asked == languages.get(q.expected_document) else f"{asked} in"

    return f"| {name} | {share('zh in', True)} | {share('en in', True)} | {share('same', True)} " \
           f"| {share('en out', False)} | {share('zh out', False)} |"


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

    sets = {name: load(path) for name, path in SETS.items()}
    results, dump, times = {}, [], []
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp))
        embedder = LocalE5Embedder()
        index = open_index(settings)
        t0 = time.monotonic()
        languages = build_index(settings, embedder, index)
        print(f"indexed {len(languages)} documents in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        for name, questions in sets.items():
            outcomes = results[name] = []
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
                dump.append({"set": name, "question": q.question, "in_corpus": q.in_corpus, "rank": rank,
                             "hits": [h.model_dump(exclude={"text"}) for h in hits]})
        index.close()
    for name, outcomes in results.items():
        print(f"\n{name}\n")
        print(evaluation.table(evaluation.summarise(COLLECTION, args.k, relevance.threshold(), outcomes)))
    print("\n| set | Chinese questions, English documents: answered | English questions, Chinese documents: "
          "answered | same language: answered | English out of corpus: refused | Chinese out of corpus: refused |"
          "\n| --- | --- | --- | --- | --- | --- |")
    for name, outcomes in results.items():
        print(gate_by_language(name, sets[name], outcomes, languages))
    print(f"\nretrieval p50 {np.percentile(times, 50) * 1000:.0f} ms per question", file=sys.stderr)
    for name, outcomes in results.items():
        for o in outcomes:
            if o.expected_document and (o.rank is None or o.rank > 1):
                print(f"  {name}: rank {o.rank}: {o.question} -> {o.top[:3]}", file=sys.stderr)
    if args.dump:
        args.dump.write_text(json.dumps(dump, ensure_ascii=False, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
