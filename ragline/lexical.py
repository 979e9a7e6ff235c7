"""The sparse (lexical) side of hybrid retrieval: BM25-style term weights for Qdrant sparse vectors.

Terms: Latin words and numbers, case-folded, apostrophes inside a word dropped, with a light English
suffix strip ("reports" -> "report"), stop words dropped; Chinese/Japanese text as character bigrams
plus single characters (no dictionary needed, robust for names and numbers like "45秒"). Documents get
the BM25 term-frequency part `tf*(k1+1)/(tf + k1*(1-b+b*len/avglen))`; the collection's sparse vector
has Qdrant's IDF modifier, which supplies the inverse document frequency at query time, so the score is
BM25.
"""

from __future__ import annotations

import re
import unicodedata
import zlib
from collections import Counter

K1 = 1.2
B = 0.75
AVG_LEN = 160.0  # terms in a typical 800-character chunk; only the length normalisation uses it

_CJK_RANGES = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_TOKEN = re.compile(rf"[{_CJK_RANGES}]+|[^\W_{_CJK_RANGES}]+", re.UNICODE)
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_STOP = frozenset("""
a an and are as at be but by can could did do does for from had has have how i if in into is it its may
me must my no not of on or our shall should so than that the their them then there these they this those
to was we were what when where which while who whom why will with would you your about according
的 了 是 在 和 有 吗 呢 什么 多少 哪些 哪里 如何 怎么 怎么样 可以 需要 一个
""".split())
# An apostrophe inside a word: "here's" and "heres", "don't" and "dont" are one term (the crazy ones PDF
# writes "Heres to the crazy ones."; asked with "Here's", the question's "s" and "here" matched nothing).
_APOSTROPHE = re.compile(r"(?<=\w)['\u2019\u02bc](?=\w)")
_SUFFIXES = ("ations", "ation", "ments", "ment", "ings", "ing", "ies", "ied", "ed", "es", "s", "ly")


def _stem(word: str) -> str:
    for suffix in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            word = word[: -len(suffix)]
            if suffix in ("ies", "ied"):
                word += "y"
            break
    return word


def terms(text: str) -> list[str]:
    text = _APOSTROPHE.sub("", unicodedata.normalize("NFKC", text).casefold())
    out: list[str] = []
    for token in _TOKEN.findall(text):
        if _CJK.match(token):
            out.extend(ch for ch in token if ch not in _STOP)
            out.extend(token[i:i + 2] for i in range(len(token) - 1) if token[i:i + 2] not in _STOP)
        elif token not in _STOP:
            out.append(_stem(token) if token.isalpha() else token)
    return out


_REFERS_BACK = re.compile(r"^\s*(and|also|so|then|what about|how about)\b|\b(it|its|they|them|their|this|that|these|"
                          r"those|he|him|his|she|her|there)\b|[它其这那该此他她]", re.IGNORECASE)


def refers_back(question: str) -> bool:
    """Whether a question leans on what was said before it ("and what caused it?", "它的原因是什么？"):
    it starts as a follow-up or points back with a pronoun."""
    return bool(_REFERS_BACK.search(unicodedata.normalize("NFKC", question)))


def term_id(term: str) -> int:
    return zlib.crc32(term.encode("utf-8")) & 0x7FFFFFFF


def document_vector(text: str) -> tuple[list[int], list[float]]:
    counts = Counter(term_id(t) for t in terms(text))
    length = sum(counts.values()) or 1
    norm = K1 * (1 - B + B * length / AVG_LEN)
    ids = sorted(counts)
    return ids, [counts[i] * (K1 + 1) / (counts[i] + norm) for i in ids]


def query_vector(text: str) -> tuple[list[int], list[float]]:
    ids = sorted({term_id(t) for t in terms(text)})
    return ids, [1.0] * len(ids)


def language(text: str) -> str:
    """"zh" when at least a fifth of the letters are CJK, else "en" (the e5 language-bias correction's groups)."""
    cjk = len(_CJK.findall(text))
    letters = sum(1 for c in text if c.isalpha())
    return "zh" if letters and cjk / letters >= 0.2 else "en"
