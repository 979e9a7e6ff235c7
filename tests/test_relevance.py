"""The calibrated relevance gate (ragline/relevance.py) as shipped, with the real e5 embedder and hybrid
retrieval over real English PDFs: a question in Chinese about them is answered from the passage that
answers it, and one they do not answer is refused ("the documents do not cover it")."""

from __future__ import annotations

import pytest

from activities.search import find_passages
from bench.quality import COLLECTION, TENANT, index_documents
from ragline import relevance
from ragline.embeddings import LocalE5Embedder
from ragline.settings import Settings
from ragline.vectorstore import open_index
from tests.conftest import shared_pdf


@pytest.fixture(scope="module")
def search(tmp_path_factory):
    settings = Settings(data_dir=tmp_path_factory.mktemp("relevance"))
    embedder = LocalE5Embedder()
    index = open_index(settings)
    index_documents(settings, embedder, index, [shared_pdf(name) for name in (
        "SF424_page2.pdf", "Seige_of_Vicksburg_Sample_OCR.pdf", "crazyones.pdf")])
    yield lambda question: find_passages(embedder, index, TENANT, COLLECTION, question, 5)
    index.close()


@pytest.mark.parametrize("question, filename, answer", [
    ("这张申请表的有效期截止到哪天？", "SF424_page2.pdf", "Expiration Date: 01/31/2009"),  # until when is the form valid?
    ("士兵一个月的军饷是多少？", "Seige_of_Vicksburg_Sample_OCR.pdf", "thirteen dollars a month"),  # a soldier's pay
])
def test_a_chinese_question_about_an_english_document_is_answered_from_it(search, question, filename, answer):
    best = search(question)[0]
    assert best.filename == filename and answer in best.text
    assert best.relevance >= relevance.threshold(), best


def test_a_chinese_question_the_documents_do_not_answer_is_refused(search):
    hits = search("明天上海会下雨吗？")  # will it rain in Shanghai tomorrow?
    assert hits and all(h.relevance < relevance.threshold() for h in hits), hits


def test_a_question_finds_the_same_passages_with_the_same_relevance_in_any_case(search):
    """e5's tokenizer is cased: the README tour's question was refused as asked and answered in lower case."""
    question = "How much were soldiers paid a month?"
    asked = [(h.document_id, h.chunk, round(h.relevance, 6)) for h in search(question)]
    assert asked and asked[0][2] >= relevance.threshold()
    for other in (question.lower(), question.upper(), "how much were SOLDIERS paid a month?"):
        assert [(h.document_id, h.chunk, round(h.relevance, 6)) for h in search(other)] == asked, other


def test_a_question_with_an_apostrophe_finds_the_words_written_without_one(search):
    """crazyones.pdf writes "Heres to the crazy ones."; asked "Here's to the crazy ones", the question's terms
    "here" and "s" matched none of the passage's, and the gate refused it (0.66)."""
    best = search("Here's to the crazy ones")[0]
    assert best.filename == "crazyones.pdf" and best.relevance >= relevance.threshold(), best


class _OtherModel:
    """An embeddings endpoint serving another model: its cosines sit elsewhere than e5's."""
    name = "text-embedding-3-small"

    def query(self, text: str) -> list[float]:
        raise AssertionError("the gate embeds nothing for a model it was not fitted with")


def test_the_hubness_feature_is_neutral_for_a_model_the_gate_was_not_fitted_with():
    """Its weight is the gate's largest: with another model's low cosines it would let every passage through
    (an unrelated passage at cosine 0.25 scored 1.0). Neutral, the gate is only stricter with such a model."""
    unrelated = relevance.features("What is the capital of Peru?", "Quarterly revenue rose.", 0.25,
                                   relevance.hubness(_OtherModel(), "What is the capital of Peru?", [0.1] * 384))
    assert relevance.probability(unrelated) < relevance.threshold()
    assert relevance.hubness(LocalE5Embedder(), "a question", None) == relevance.MISSING_VECTOR_HUBNESS  # no vector
