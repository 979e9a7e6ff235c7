"""Is a retrieved passage relevant enough to answer from? A calibrated probability, not a raw cosine.

e5 cosines sit in a narrow band (about 0.70-0.92) whose meaning shifts with the language pair (a
Chinese question scores every Chinese passage higher than any English one) and with the passage: some
(a form's labels, a page of code lists, a line in many scripts) are close to every question, so their
cosine says less about any one. That "hubness" is what sank Chinese questions about English documents:
the passage that answers scores about as high as the hubs do for questions nothing answers. So the gate
is a logistic model over four features of a (question, passage) pair:

  cosine    the e5 cosine, centred on 0.80 and scaled by 10
  cross     1 when question and passage are in different language groups (en / zh)
  coverage  the share of the question's lexical terms (ragline/lexical.py) found in the passage
  hubness   the passage's mean cosine to everyday questions in the question's language that no document
            answers (GENERIC_QUESTIONS), centred on 0.75 and scaled by 10: the correction of cross-lingual
            retrieval known as CSLS, with a fixed set of questions as the neighbourhood (neutral for an
            embedding model the gate was not fitted with)

fitted by `python -m bench.calibrate` on the labelled set bench/eval/golden.jsonl (in-corpus questions:
their first passage from the expected document is a positive, every other passage a negative;
out-of-corpus questions: every passage a negative) and checked on bench/eval/holdout.jsonl, which the
fit never sees. The coefficients and the chosen threshold live in `relevance.toml` beside this file;
RAGLINE_RELEVANCE_THRESHOLD overrides the threshold. A turn whose best passage scores below the
threshold answers "the documents do not cover it" without calling a model.
"""

from __future__ import annotations

import math
import tomllib
import weakref
from functools import lru_cache
from pathlib import Path

from ragline import lexical

MODEL_FILE = Path(__file__).with_name("relevance.toml")
FITTED_MODEL = "multilingual-e5-small"
NEUTRAL_HUBNESS = 0.75  # the centre of the feature: (hub - 0.75) * 10 = 0
# For a passage stored without its vector: as hub-like as e5 passages get (their hubness is about 0.76-0.80),
# so that the missing feature never favours it.
MISSING_VECTOR_HUBNESS = 0.80

# Questions about everyday things, none of which any document of a deployment is expected to answer.
# Changing them changes the hubness feature: refit (`python -m bench.calibrate --write`) afterwards.
GENERIC_QUESTIONS = {
    "en": ["What day of the week is it today?", "How can I get better at maths?", "Why do cats sleep so much?",
           "Where can I find cheap flights?", "How do I sleep better?", "How many planets are in the solar system?",
           "How do you cook rice properly?", "What should I do when my child has a fever?"],
    "zh": ["今天是星期几？", "怎么学好数学？", "猫为什么喜欢睡觉？", "哪里可以买到便宜的机票？",
           "如何提高睡眠质量？", "太阳系有几颗行星？", "怎样煮米饭才好吃？", "孩子发烧了怎么办？"],
}


@lru_cache
def model() -> dict:
    return tomllib.loads(MODEL_FILE.read_text(encoding="utf-8"))


def threshold(override: float | None = None) -> float:
    """RAGLINE_RELEVANCE_THRESHOLD when set (pass `settings.relevance_threshold`), else the calibrated one."""
    return float(override if override is not None else model()["threshold"])


def _unit(v: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / norm for x in v]


# Per embedder (weakly held: a worker's embedder, a test's) and language.
_centroids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _generic_centroid(embedder, language: str) -> list[float]:  # noqa: ANN001
    """The mean of the generic questions' unit vectors: its dot product with a passage's unit vector is the
    passage's mean cosine to them. Embedded once per embedder and language."""
    known = _centroids.setdefault(embedder, {})
    if language not in known:
        vectors = [_unit(embedder.query(q)) for q in GENERIC_QUESTIONS[language]]
        known[language] = [sum(column) / len(vectors) for column in zip(*vectors)]
    return known[language]


def fitted_for(embedder) -> bool:  # noqa: ANN001
    """The coefficients hold for the embedding model they were fitted with: multilingual-e5-small (in-process,
    or served by an embeddings endpoint under that name)."""
    return FITTED_MODEL in embedder.name.lower()


def hubness(embedder, question: str, passage_vector: list[float] | None) -> float:  # noqa: ANN001
    """The passage's mean cosine to everyday questions in the question's language. Neutral (it moves no
    probability) for another embedding model, whose cosines sit elsewhere: there this feature, with the
    largest weight, would wave every passage through, where the cosine's own weight only makes the gate
    stricter (README: a refit, or RAGLINE_RELEVANCE_THRESHOLD). A point stored without its vector counts as
    a hub: the missing feature must not let it through."""
    if not fitted_for(embedder):
        return NEUTRAL_HUBNESS
    if passage_vector is None:
        return MISSING_VECTOR_HUBNESS
    centroid = _generic_centroid(embedder, lexical.language(question))
    return sum(a * b for a, b in zip(centroid, _unit(passage_vector), strict=True))


def warm(embedder) -> None:  # noqa: ANN001
    """Embed the everyday questions now (a worker's start), not inside the first question of each language."""
    if fitted_for(embedder):
        for language in GENERIC_QUESTIONS:
            _generic_centroid(embedder, language)


def features(question: str, passage: str, cosine: float, hub: float) -> list[float]:
    q_terms = set(lexical.terms(question))
    coverage = len(q_terms & set(lexical.terms(passage))) / len(q_terms) if q_terms else 0.0
    cross = float(lexical.language(question) != lexical.language(passage))
    return [(cosine - 0.80) * 10, cross, coverage, (hub - 0.75) * 10]


def probability(feats: list[float], coefficients: list[float] | None = None, intercept: float | None = None) -> float:
    m = model()
    w = coefficients if coefficients is not None else m["coefficients"]
    b = intercept if intercept is not None else m["intercept"]
    if len(w) != len(feats):
        raise ValueError(f"{MODEL_FILE.name} has {len(w)} coefficients for {len(feats)} features: refit it "
                         "(python -m bench.calibrate --write)")
    z = b + sum(wi * xi for wi, xi in zip(w, feats))
    return 1 / (1 + math.exp(-max(-60.0, min(60.0, z))))
