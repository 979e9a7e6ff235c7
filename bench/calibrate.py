"""Fit the relevance gate (ragline/relevance.py) on the labelled set and write ragline/relevance.toml:
`python -m bench.calibrate [--write]`.

Every question retrieves its top candidates with the real hybrid retrieval (activities/search.py
`candidates`, in fused order, so the labels do not depend on the model being replaced). Positives: for
an in-corpus question, its first passage from the expected document. Negatives: every passage from
another document, and every passage for an out-of-corpus question. A logistic regression (numpy, L2)
over the features gives each passage a probability; a question is answered when its best candidate
reaches the threshold (as `find_passages` reranks them), and the threshold is chosen on that decision,
"answer or say the documents do not cover it", by balanced accuracy on bench/eval/golden.jsonl. The
precision/recall trade-off is printed (README), then the same decision on bench/eval/holdout.jsonl,
questions the fit never saw.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.quality import COLLECTION, GOLDEN, HOLDOUT, TENANT, build_index, load


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


def candidate_rows(questions: list, embedder, index) -> list[tuple[int, list[float], int | None]]:  # noqa: ANN001
    """(question index, features, label) for every candidate; label None for later passages of the
    expected document (neither label is sure), which still count for the question's decision."""
    from activities.search import candidates

    rows = []
    for qi, q in enumerate(questions):
        seen_expected = False
        for hit, feats in candidates(embedder, index, TENANT, COLLECTION, q.question):
            expected = q.expected_document in (hit.document_id, hit.filename)
            rows.append((qi, feats, None if expected and seen_expected else int(expected)))
            seen_expected = seen_expected or expected
    return rows


def best_per_question(rows: list, w: np.ndarray, b: float) -> dict[int, float]:
    best: dict[int, float] = {}
    for qi, feats, _ in rows:
        p = float(1 / (1 + np.exp(-(np.dot(w, feats) + b))))
        best[qi] = max(best.get(qi, 0.0), p)
    return best


def out_of_fold(rows: list, folds: int = 5) -> dict[int, float]:
    """Each question's best-candidate probability from a model fitted without it (folds by question, a
    fixed shuffle): what the gate will do on questions it was not fitted on, to choose the threshold by."""
    questions = max(qi for qi, _, _ in rows) + 1
    fold = np.random.default_rng(0).permutation(questions) % folds
    best: dict[int, float] = {}
    for k in range(folds):
        train = [r for r in rows if fold[r[0]] != k and r[2] is not None]
        w, b = fit(np.array([r[1] for r in train]), np.array([r[2] for r in train], dtype=float))
        best.update(best_per_question([r for r in rows if fold[r[0]] == k], w, b))
    return best


def gate(questions: list, best: dict[int, float], t: float) -> tuple[float, float, float]:
    """In-corpus questions answered (recall), answered questions that are in corpus (precision) and
    out-of-corpus questions refused, at threshold t."""
    inside = [i for i, q in enumerate(questions) if q.in_corpus]
    outside = [i for i, q in enumerate(questions) if not q.in_corpus]
    answered = [i for i in best if best[i] >= t]
    recall = sum(1 for i in inside if best.get(i, 0) >= t) / len(inside)
    precision = sum(1 for i in answered if questions[i].in_corpus) / len(answered) if answered else 1.0
    refused = sum(1 for i in outside if best.get(i, 0) < t) / len(outside)
    return recall, precision, refused


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.calibrate")
    parser.add_argument("--write", action="store_true", help="write ragline/relevance.toml")
    args = parser.parse_args(argv)

    from ragline import relevance
    from ragline.embeddings import LocalE5Embedder
    from ragline.settings import Settings
    from ragline.vectorstore import open_index

    fit_questions, held_questions = load(GOLDEN), load(HOLDOUT)
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp))
        embedder = LocalE5Embedder()
        index = open_index(settings)
        build_index(settings, embedder, index)
        rows = candidate_rows(fit_questions, embedder, index)
        held_rows = candidate_rows(held_questions, embedder, index)
        index.close()
    labelled = [r for r in rows if r[2] is not None]
    X = np.array([r[1] for r in labelled])
    y = np.array([r[2] for r in labelled], dtype=float)
    w, b = fit(X, y)
    print(f"coefficients {np.round(w, 3).tolist()} intercept {b:.3f} on {len(y)} passages ({int(y.sum())} positive)")
    best = out_of_fold(rows)
    print(f"\n{GOLDEN.name}: {len(fit_questions)} questions, each scored by a model fitted without it (5 folds)")
    print("\n| threshold | in-corpus answered (recall) | answered that are in corpus (precision) | out-of-corpus refused |")
    print("| --- | --- | --- | --- |")
    choice, choice_score = 0.5, -1.0
    for t in np.arange(0.05, 0.96, 0.05):
        recall, precision, refused = gate(fit_questions, best, t)
        print(f"| {t:.2f} | {recall:.3f} | {precision:.3f} | {refused:.3f} |")
        score = recall + refused  # balanced accuracy of the gate
        if score > choice_score + 1e-9:
            choice, choice_score = round(float(t), 2), score
    print(f"\nchosen threshold {choice} (best balanced accuracy {choice_score / 2:.3f})")
    recall, precision, refused = gate(held_questions, best_per_question(held_rows, w, b), choice)
    print(f"{HOLDOUT.name} ({len(held_questions)} questions the fit did not see) at {choice}: in-corpus answered "
          f"{recall:.3f}, precision {precision:.3f}, out-of-corpus refused {refused:.3f}")
    if args.write:
        relevance.MODEL_FILE.write_text(
            "# Written by `python -m bench.calibrate --write` (see ragline/relevance.py).\n"
            "# Features: (cosine - 0.80) * 10, cross-language (0/1), coverage of the question's terms (0..1),\n"
            "# (hubness - 0.75) * 10.\n"
            f"coefficients = {[round(float(v), 4) for v in w]}\nintercept = {round(float(b), 4)}\n"
            f"threshold = {choice}\n", encoding="utf-8")
        print(f"wrote {relevance.MODEL_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
