"""Fit the relevance gate (ragline/relevance.py) on the labelled set and write ragline/relevance.toml:
`python -m bench.calibrate [--write]`.

Every question retrieves its top candidates with the real hybrid retrieval. Positives: for an in-corpus
question, its best-ranked passage from the expected document. Negatives: every passage from another
document, and every passage for an out-of-corpus question. A logistic regression (numpy, L2) over the
features gives each passage a probability; the threshold is then chosen on the question-level decision
"answer or say the documents do not cover it", and the precision/recall trade-off is printed (README).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.quality import COLLECTION, GOLDEN, TENANT, build_index

CANDIDATES = 10


def fit(X: np.ndarray, y: np.ndarray, l2: float = 0.001, steps: int = 20000, lr: float = 0.5):
    w = np.zeros(X.shape[1])
    b = 0.0
    pos_weight = (len(y) - y.sum()) / max(y.sum(), 1)  # balance the classes
    sw = np.where(y == 1, pos_weight, 1.0)
    for _ in range(steps):
        p = 1 / (1 + np.exp(-(X @ w + b)))
        g = (p - y) * sw
        w -= lr * (X.T @ g / len(y) + l2 * w)
        b -= lr * g.mean()
    return w, b


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.calibrate")
    parser.add_argument("--write", action="store_true", help="write ragline/relevance.toml")
    parser.add_argument("--k", type=int, default=5)
    args = parser.parse_args(argv)

    from activities.search import find_passages
    from ragline import evaluation, relevance
    from ragline.embeddings import LocalE5Embedder
    from ragline.settings import Settings
    from ragline.vectorstore import open_index

    questions = evaluation.parse_jsonl(GOLDEN.read_text(encoding="utf-8"))
    rows = []  # (question index, rank, features, label)
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp))
        embedder = LocalE5Embedder()
        index = open_index(settings)
        build_index(settings, embedder, index)
        for qi, q in enumerate(questions):
            hits = find_passages(embedder, index, TENANT, COLLECTION, q.question, CANDIDATES)
            seen_expected = False
            for rank, h in enumerate(hits):
                expected = q.expected_document in (h.document_id, h.filename)
                if expected and seen_expected:
                    continue  # later passages of the expected document: neither label is sure
                label = 1 if expected else 0
                seen_expected = seen_expected or expected
                rows.append((qi, rank, relevance.features(q.question, h.text, h.score), label))
        index.close()
    X = np.array([r[2] for r in rows])
    y = np.array([r[3] for r in rows], dtype=float)
    w, b = fit(X, y)
    probs = 1 / (1 + np.exp(-(X @ w + b)))
    print(f"coefficients {np.round(w, 3).tolist()} intercept {b:.3f} on {len(y)} passages ({int(y.sum())} positive)")
    best = {}
    for (qi, rank, _, _), p in zip(rows, probs):
        if rank < args.k:
            best[qi] = max(best.get(qi, 0.0), p)
    inside = [i for i, q in enumerate(questions) if q.in_corpus]
    outside = [i for i, q in enumerate(questions) if not q.in_corpus]
    print("\n| threshold | in-corpus answered (recall) | answered that are in corpus (precision) | out-of-corpus refused |")
    print("| --- | --- | --- | --- |")
    choice, choice_score = 0.5, -1.0
    for t in np.arange(0.05, 0.96, 0.05):
        answered = [i for i in best if best[i] >= t]
        recall = sum(1 for i in inside if best.get(i, 0) >= t) / len(inside)
        precision = sum(1 for i in answered if questions[i].in_corpus) / len(answered) if answered else 1.0
        refused = sum(1 for i in outside if best.get(i, 0) < t) / len(outside)
        print(f"| {t:.2f} | {recall:.3f} | {precision:.3f} | {refused:.3f} |")
        score = recall + refused  # balanced accuracy of the gate
        if score > choice_score + 1e-9:
            choice, choice_score = round(float(t), 2), score
    print(f"\nchosen threshold {choice} (best balanced accuracy {choice_score / 2:.3f})")
    if args.write:
        relevance.MODEL_FILE.write_text(
            "# Written by `python -m bench.calibrate --write` (see ragline/relevance.py).\n"
            "# Features: (cosine - 0.80) * 10, cross-language (0/1), coverage of the question's terms (0..1).\n"
            f"coefficients = {[round(float(v), 4) for v in w]}\nintercept = {round(float(b), 4)}\n"
            f"threshold = {choice}\n", encoding="utf-8")
        print(f"wrote {relevance.MODEL_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
