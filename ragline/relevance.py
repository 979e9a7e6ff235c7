"""Is a retrieved passage relevant enough to answer from? A calibrated probability, not a raw cosine.

e5 cosines sit in a narrow band (about 0.70-0.92) whose meaning shifts with the language pair: a
Chinese question scores every Chinese passage higher than any English one. So the gate is a logistic
model over three features of a (question, passage) pair:

  cosine    the e5 cosine, centred on 0.80 and scaled by 10
  cross     1 when question and passage are in different language groups (en / zh)
  coverage  the share of the question's lexical terms (ragline/lexical.py) found in the passage

fitted by `python -m bench.calibrate` on the labelled set bench/eval/golden.jsonl (in-corpus questions:
their best passage from the expected document is a positive, every other passage a negative;
out-of-corpus questions: every passage a negative). The coefficients and the chosen threshold live in
`relevance.toml` beside this file; RAGLINE_RELEVANCE_THRESHOLD overrides the threshold. A turn whose best
passage scores below the threshold answers "the documents do not cover it" without calling a model.
"""

from __future__ import annotations

import math
import tomllib
from functools import lru_cache
from pathlib import Path

from ragline import lexical

MODEL_FILE = Path(__file__).with_name("relevance.toml")


@lru_cache
def model() -> dict:
    return tomllib.loads(MODEL_FILE.read_text(encoding="utf-8"))


def threshold(override: float | None = None) -> float:
    """RAGLINE_RELEVANCE_THRESHOLD when set (pass `settings.relevance_threshold`), else the calibrated one."""
    return float(override if override is not None else model()["threshold"])


def features(question: str, passage: str, cosine: float) -> list[float]:
    q_terms = set(lexical.terms(question))
    coverage = len(q_terms & set(lexical.terms(passage))) / len(q_terms) if q_terms else 0.0
    cross = float(lexical.language(question) != lexical.language(passage))
    return [(cosine - 0.80) * 10, cross, coverage]


def probability(feats: list[float], coefficients: list[float] | None = None, intercept: float | None = None) -> float:
    m = model()
    w = coefficients if coefficients is not None else m["coefficients"]
    b = intercept if intercept is not None else m["intercept"]
    z = b + sum(wi * xi for wi, xi in zip(w, feats))
    return 1 / (1 + math.exp(-max(-60.0, min(60.0, z))))


def score(question: str, passage: str, cosine: float) -> float:
    return round(probability(features(question, passage, cosine)), 4)
