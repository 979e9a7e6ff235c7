"""ragline.text: sniffing, extraction (real-world and generated PDFs), normalisation, chunking."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # flat layout: make the top-level packages importable under plain `pytest`
    sys.path.insert(0, str(ROOT))

from ragline.errors import InputError  # noqa: E402
from ragline.text import (  # noqa: E402
    Chunk,
    Page,
    check_has_text,
    chunk_pages,
    count_text_chars,
    extract_pages,
    normalize,
    sniff_kind,
)
from tests.pdfgen import pdf_bytes, write_pdf  # noqa: E402

# Documented default (settings.min_text_chars).
MIN_TEXT_CHARS = 16
PDFS = Path(__file__).resolve().parent.parent.parent / "shared" / "pdfs"


@pytest.fixture
def shared_pdfs() -> Path:
    """The real-world PDFs: part of the test setup, a test that needs them fails without them."""
    if not PDFS.is_dir():
        pytest.fail(f"real-world PDFs not found at {PDFS}: they are part of the test setup (shared/ must sit "
                    "beside the project)", pytrace=False)
    return PDFS


needs_pdfs = pytest.mark.usefixtures("shared_pdfs")


def read(name: str) -> bytes:
    return (PDFS / name).read_bytes()


def ingest(data: bytes, kind: str = "pdf", password: str | None = None) -> list[Chunk]:
    """What the extract and chunk activities do with one upload."""
    pages = extract_pages(data, kind, password=password)
    check_has_text(pages, MIN_TEXT_CHARS)
    return chunk_pages(pages)


def error_of(data: bytes, kind: str = "pdf", password: str | None = None) -> str:
    with pytest.raises(InputError) as caught:
        ingest(data, kind, password)
    return caught.value.message


def full_text(pages: list[Page]) -> str:
    return "\n\n".join(normalize(p.text) for p in pages)


# ---------------------------------------------------------------------------------------------
# sniff_kind


@pytest.mark.parametrize(
    ("head", "kind"),
    [
        (b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj", "pdf"),
        (b"\r\n" * 100 + b"%PDF-1.4\n", "pdf"),  # junk before the header is tolerated by readers
        (b"x" * 1024 + b"%PDF-1.4\n", "text"),  # ...but only within the first KiB
        (b"\x00\x1b junk\xff%PDF-1.4\n%\xe2\xe3", "pdf"),  # binary junk, then the header
        (b"# PDF notes\n\nEvery file starts with the header %PDF-1.7, then objects.\n", "text"),  # quoted in a note
        ("\ufeff%PDF-1.5\n".encode(), "pdf"),
        (b"# Title\n\nSome *markdown* text.\n", "text"),
        ("\ufeffWith a BOM and ümlauts".encode(), "text"),
        ("中文文本".encode()[:-1], "text"),  # head cut in the middle of a character
        (b"tab\tand\r\nCRLF\fform feed", "text"),
        (b"", "text"),  # fails later as "no extractable text"
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", None),
        (b"\xff\xd8\xff\xe0\x00\x10JFIF", None),
        (b"PK\x03\x04\x14\x00\x06\x00", None),
        (b"\x7fELF\x02\x01\x01" + b"\x00" * 9, None),
        ("Grüße aus Köln".encode("latin-1"), None),  # not UTF-8
        ("UTF-16 text".encode("utf-16"), None),  # NULs
        (b"mostly text but \x01\x02\x03 control bytes", None),
    ],
)
def test_sniff_kind(head: bytes, kind: str | None) -> None:
    assert sniff_kind(head) == kind


@needs_pdfs
def test_sniff_kind_recognises_every_real_pdf() -> None:
    assert {sniff_kind(p.read_bytes()[:1024]) for p in PDFS.rglob("*.pdf")} == {"pdf"}


# ---------------------------------------------------------------------------------------------
# Real-world PDFs

INDEXED = [
    "crazyones.pdf", "commented.pdf", "attachment.pdf", "example.pdf", "Seige_of_Vicksburg_Sample_OCR.pdf",
    "GeoBase_NHNC1_Data_Model_UML_EN.pdf", "pdflatex-outline.pdf", "hello-world.pdf", "multilang.pdf",
    "side-by-side-subfig.pdf", "SF424_page2.pdf", "test-orient.pdf", "missing_info.pdf", "toy.pdf",
    "bytes.pdf", "imagemagick-images.pdf", "jpeg.pdf", "issue-301.pdf",
]
# Below MIN_TEXT_CHARS non-whitespace characters: (file, characters found).
NO_TEXT = [("git.pdf", 0), ("two-different-pages.pdf", 2), ("form.pdf", 4), ("metadata.pdf", 9), ("issue-297.pdf", 11)]


@needs_pdfs
@pytest.mark.parametrize("name", INDEXED)
def test_real_pdf_is_indexed(name: str) -> None:
    data = read(name)
    pages = extract_pages(data, "pdf")
    assert count_text_chars(pages) >= MIN_TEXT_CHARS
    assert not [p for p in pages if p.error]
    chunks = chunk_pages(pages)
    assert chunks
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert all(c.text.strip() and len(c.text) <= 800 for c in chunks)
    assert all(1 <= c.page <= len(pages) for c in chunks)
    assert [c.page for c in chunks] == sorted(c.page for c in chunks)


@needs_pdfs
@pytest.mark.parametrize(("name", "chars"), NO_TEXT)
def test_real_pdf_without_enough_text_is_rejected(name: str, chars: int) -> None:
    assert error_of(read(name)) == f"no extractable text ({chars} characters; at least {MIN_TEXT_CHARS} needed)"


@needs_pdfs
def test_crazyones_text_is_retrievable() -> None:
    chunks = ingest(read("crazyones.pdf"))
    text = " ".join(c.text for c in chunks)
    # pypdf finds no glyph for the apostrophe in this file: "Heres".
    assert "Heres to the crazy ones. The misfits. The rebels." in text  # "ﬁ" ligature unfolded
    assert "people who are crazy enough to think they can change the world" in text


@needs_pdfs
def test_multilang_keeps_non_latin_text() -> None:
    text = " ".join(c.text for c in ingest(read("multilang.pdf")))
    for phrase in ["Hello World", "مرحبا بالعالم", "Привет, мир", "你好世界", "สวัสดีชาวโลก", "こんにちは世界"]:
        assert phrase in text


@needs_pdfs
def test_multi_page_documents_give_many_chunks_on_the_right_pages() -> None:
    seige = ingest(read("Seige_of_Vicksburg_Sample_OCR.pdf"))
    assert len(seige) >= 10
    assert {c.page for c in seige} == set(range(1, 7))
    assert "dangerous for use" in seige[0].text  # "dan- \ngerous" rejoined
    geobase = ingest(read("GeoBase_NHNC1_Data_Model_UML_EN.pdf"))
    assert len(geobase) >= 20 and max(c.page for c in geobase) == 19


# ---------------------------------------------------------------------------------------------
# Encryption

ENCRYPTION_TEXT = "pdf encryption test"
USER = "asdfzxcv"
# (file in encryption/, password given, expected error or None for readable)
ENCRYPTION_CASES = [
    ("unencrypted.pdf", None, None),
    ("unencrypted.pdf", "ignored", None),
    ("r2-empty-password.pdf", None, None),
    ("r3-empty-password.pdf", None, None),
    ("r5-empty-password.pdf", None, None),
    ("r6-empty-password.pdf", None, None),
    ("r4-aes-v2-no-key-length.pdf", None, None),
    ("r6-empty-password.pdf", "not needed", None),  # readable anyway, whatever was typed
    ("r2-user-password.pdf", None, "encrypted: password required"),
    ("r2-user-password.pdf", USER, None),
    ("r3-user-password.pdf", None, "encrypted: password required"),
    ("r3-user-password.pdf", USER, None),
    ("r4-user-password.pdf", None, "encrypted: password required"),
    ("r4-user-password.pdf", USER, None),
    ("r4-user-password.pdf", "wrong", "encrypted: wrong password"),
    ("r4-aes-user-password.pdf", None, "encrypted: password required"),
    ("r4-aes-user-password.pdf", USER, None),
    ("r5-user-password.pdf", None, None),  # empty owner password
    ("r6-user-password.pdf", None, None),
    ("r2-owner-password.pdf", None, None),
    ("r4-owner-password.pdf", None, None),
    ("r5-owner-password.pdf", USER, None),
    ("r6-owner-password.pdf", None, None),
    ("r6-both-passwords.pdf", None, "encrypted: password required"),
    ("r6-both-passwords.pdf", "foo", None),
    ("r6-both-passwords.pdf", "bar", None),
    ("r6-both-passwords.pdf", "baz", "encrypted: wrong password"),
    ("r6-both-passwords.pdf", "", "encrypted: password required"),
]


@needs_pdfs
@pytest.mark.parametrize(("name", "password", "error"), ENCRYPTION_CASES)
def test_encryption_folder(name: str, password: str | None, error: str | None) -> None:
    data = read(f"encryption/{name}")
    if error:
        assert error_of(data, password=password) == error
    else:
        assert ENCRYPTION_TEXT in " ".join(c.text for c in ingest(data, password=password))


@needs_pdfs
@pytest.mark.parametrize(
    ("name", "password", "phrase"),
    [
        ("libreoffice-writer-password.pdf", "openpassword", "Lorem ipsum dolor sit amet"),
        ("crazyones-encrypted-256.pdf", "password", "Heres to the crazy ones. The misfits."),
    ],
)
def test_password_protected_pdfs(name: str, password: str, phrase: str) -> None:
    data = read(name)
    assert error_of(data) == "encrypted: password required"
    assert error_of(data, password="wrong") == "encrypted: wrong password"
    assert phrase in " ".join(c.text for c in ingest(data, password=password))


@needs_pdfs
def test_encrypted_file_pdf_opens_with_its_password_but_holds_one_word() -> None:
    data = read("encrypted-file.pdf")
    assert error_of(data) == "encrypted: password required"
    assert error_of(data, password="nope") == "encrypted: wrong password"
    pages = extract_pages(data, "pdf", password="test")
    assert [p.text for p in pages] == ["Example"]
    # The whole document is the word "Example": below the documented threshold.
    assert error_of(data, password="test") == "no extractable text (7 characters; at least 16 needed)"


# ---------------------------------------------------------------------------------------------
# Corrupt and unsupported input


@needs_pdfs
@pytest.mark.parametrize(
    "name",
    ["crazyones.pdf", "example.pdf", "multilang.pdf", "Seige_of_Vicksburg_Sample_OCR.pdf",
     "GeoBase_NHNC1_Data_Model_UML_EN.pdf", "pdflatex-outline.pdf", "encrypted-file.pdf"],
)
def test_truncated_pdf_is_corrupt(name: str) -> None:
    data = read(name)
    assert error_of(data[: len(data) * 6 // 10]).startswith("corrupt PDF: ")


@needs_pdfs
@pytest.mark.parametrize("name", ["crazyones.pdf", "commented.pdf", "Seige_of_Vicksburg_Sample_OCR.pdf", "toy.pdf"])
def test_truncation_never_gives_partial_or_empty_success(name: str) -> None:
    data = read(name)
    expected = full_text(extract_pages(data, "pdf"))
    for percent in (5, 30, 60, 85, 90, 95, 99):
        try:
            pages = extract_pages(data[: len(data) * percent // 100], "pdf")
        except InputError as exc:
            assert exc.message.startswith("corrupt PDF: ")
        else:  # only an intact earlier revision of the file may be read
            assert full_text(pages) == expected


@needs_pdfs
def test_truncated_incremental_update_reads_the_earlier_revision() -> None:
    # commented.pdf adds annotations in incremental updates; cutting one off leaves a whole PDF.
    data = read("commented.pdf")
    pages = extract_pages(data[: len(data) * 9 // 10], "pdf")
    assert full_text(pages) == full_text(extract_pages(data, "pdf"))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"%PDF-1.4\n",
        b"%PDF-1.4\n1 0 obj garbage (((\n%%EOF\n",
        b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4,
        b"PK\x03\x04\x14\x00\x06\x00" + b"\x00" * 200,
        b"Just some text that was renamed to .pdf\n",
    ],
)
def test_non_pdf_bytes_are_corrupt(data: bytes) -> None:
    assert error_of(data).startswith("corrupt PDF: ")


def _damage_content_stream(pdf: bytes, page: int) -> bytes:
    """Overwrite the start of a page's content stream with binary junk, keeping every offset."""
    starts = [m.end() for m in re.finditer(rb"stream\n", pdf) if pdf[m.start() - 3:m.start()] != b"end"]
    at = starts[page - 1]
    return pdf[:at] + bytes(range(1, 31)) + pdf[at + 30:]


def test_unreadable_page_is_skipped_and_reported() -> None:
    data = _damage_content_stream(pdf_bytes(["First page.", "Second page.", "Third page."]), 2)
    pages = extract_pages(data, "pdf")
    assert [p.number for p in pages] == [1, 2, 3]
    assert [p.text for p in pages] == ["First page.", "", "Third page."]
    assert pages[1].error and not pages[0].error and not pages[2].error


def test_pdf_whose_pages_all_fail_is_corrupt() -> None:
    data = pdf_bytes(["First page.", "Second page."])
    data = _damage_content_stream(_damage_content_stream(data, 1), 2)
    with pytest.raises(InputError, match=r"^corrupt PDF: no page could be read"):
        extract_pages(data, "pdf")


def test_damaged_page_tree_is_corrupt_not_silently_shorter() -> None:
    data = pdf_bytes(["First page.", "Second page.", "Third page."])
    data = data.replace(b"/Kids [4 0 R 6 0 R 8 0 R]", b"/Kids [4 0 R 66 0 R 8 0 R]")
    with pytest.raises(InputError, match=r"^corrupt PDF: page tree damaged \(2 of 3 pages found\)"):
        extract_pages(data, "pdf")


def test_unknown_kind_is_input_error() -> None:
    with pytest.raises(InputError, match="^unsupported file type"):
        extract_pages(b"\x89PNG", None)  # type: ignore[arg-type]  # what sniff_kind gives for images


# ---------------------------------------------------------------------------------------------
# Page limits and generated PDFs


def test_max_pages_is_checked_before_extraction() -> None:
    data = pdf_bytes([f"Page {n}." for n in range(1, 6)])
    seen: list[tuple[int, int]] = []
    with pytest.raises(InputError, match=r"^too many pages: 5 > 4$"):
        extract_pages(data, "pdf", max_pages=4, on_page=lambda *args: seen.append(args))
    assert seen == []
    pages = extract_pages(data, "pdf", max_pages=5, on_page=lambda *args: seen.append(args))
    assert [p.text for p in pages] == [f"Page {n}." for n in range(1, 6)]
    assert seen == [(n, 5) for n in range(1, 6)]


def test_pdfgen_round_trip_600_pages() -> None:
    texts = [f"This is page {n} of the long report.\nIt has a second line with (parens) and a \\." for n in range(1, 601)]
    data = pdf_bytes(texts)
    seen: list[tuple[int, int]] = []
    with pytest.raises(InputError, match=r"^too many pages: 600 > 500$"):
        extract_pages(data, "pdf", on_page=lambda *args: seen.append(args))
    assert seen == [], "pages were extracted before the page count was checked"
    pages = extract_pages(data, "pdf", max_pages=600)
    assert [p.number for p in pages] == list(range(1, 601))
    assert [p.text for p in pages] == texts
    chunks = chunk_pages(pages)
    assert all(f"This is page {c.page} of" in c.text for c in chunks)
    assert chunks[-1].text.endswith("This is page 600 of the long report. It has a second line with (parens) and a \\.")


def test_pdfgen_writes_latin1_text(tmp_path: Path) -> None:
    path = write_pdf(tmp_path / "doc.pdf", ["Café crème, naïve façade.", "Zweite Seite: Grüße"])
    pages = extract_pages(path.read_bytes(), "pdf")
    assert [p.text for p in pages] == ["Café crème, naïve façade.", "Zweite Seite: Grüße"]


# ---------------------------------------------------------------------------------------------
# Text files


def test_text_file_is_one_page() -> None:
    calls: list[tuple[int, int]] = []
    pages = extract_pages("\ufeff# Notes\r\n\r\nSome text.\r\n".encode(), "text", on_page=lambda *a: calls.append(a))
    assert pages == [Page(1, "# Notes\r\n\r\nSome text.\r\n")]
    assert calls == [(1, 1)]
    assert normalize(pages[0].text) == "# Notes\n\nSome text."


def test_text_file_must_be_utf8() -> None:
    assert error_of("Grüße".encode("latin-1"), kind="text") == "not valid UTF-8 text"


def test_empty_text_file_has_no_text() -> None:
    assert error_of(b"   \n\n", kind="text") == "no extractable text (0 characters; at least 16 needed)"


# ---------------------------------------------------------------------------------------------
# normalize


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("The ﬁrst ﬂoor is diﬀerent", "The first floor is different"),  # NFKC ligatures
        ("Ｆｕｌｌ width　space", "Full width space"),
        ("an exam-\nple of hyphen-\nation", "an example of hyphenation"),
        ("dan- \ngerous", "dangerous"),  # OCR leaves a space after the hyphen
        ("a well-known, state-of-the-art tool", "a well-known, state-of-the-art tool"),
        ("COVID-\n19 and Jean-\nPaul", "COVID-19 and Jean-Paul"),
        ("soft\u00ad\nhyphen and in\u00adline", "softhyphen and inline"),
        ("中文文本\n继续。\n第二行", "中文文本继续。第二行"),  # no space inside CJK text
        ("他说：“好。”\n然后走了", "他说:“好。”然后走了"),
        ("中文\nEnglish", "中文 English"),
        ("한국어\n문장", "한국어 문장"),  # Korean separates words with spaces
        ("lines\nof one\nparagraph", "lines of one paragraph"),
        ("one\n\n\n  two  \n \n three", "one\n\ntwo\n\nthree"),
        ("tabs\t\tand   spaces  ", "tabs and spaces"),
        ("CRLF\r\nlines\r\n\r\nnext", "CRLF lines\n\nnext"),
        ("page\fbreak", "page\n\nbreak"),
        ("ctrl\x00\x07chars\x1b and\u200bzero\ufeffwidth", "ctrlchars andzerowidth"),
        ("  \n\t \n", ""),
    ],
)
def test_normalize(raw: str, clean: str) -> None:
    assert normalize(raw) == clean


def test_count_text_chars_and_threshold() -> None:
    pages = [Page(1, "ab ﬁ\n"), Page(2, " \t\n"), Page(3, "中文")]
    assert count_text_chars(pages) == 6
    check_has_text(pages, 6)
    with pytest.raises(InputError, match=r"^no extractable text \(6 characters; at least 7 needed\)$"):
        check_has_text(pages, 7)


# ---------------------------------------------------------------------------------------------
# chunk_pages


def test_chinese_text_splits_at_full_stops_with_overlap() -> None:
    sentences = [f"这是第{n}句话，用来测试中文文本的分块效果。" for n in range(1, 31)]
    pages = [Page(1, "".join(sentences[:15]) + "\n" + "".join(sentences[15:]))]
    chunks = chunk_pages(pages, size=100, overlap=30)
    expected = [normalize(s) for s in sentences]
    assert len(chunks) > 5
    for previous, chunk in zip(chunks, chunks[1:]):
        assert chunk.text.startswith(previous.text.split("。")[-2] + "。")  # last sentence repeated
    seen: list[str] = []
    for chunk in chunks:
        assert len(chunk.text) <= 100 and chunk.text.endswith("。") and " " not in chunk.text
        parts = [p + "。" for p in chunk.text.split("。")[:-1]]
        assert all(p in expected for p in parts)  # whole sentences only
        seen += [p for p in parts if p not in seen]
    assert seen == expected


def test_other_chinese_terminators_and_closing_quotes() -> None:
    text = "你好吗？我很好！他说：“走吧。”我们走了；天黑了。" * 3
    chunks = chunk_pages([Page(1, text)], size=20, overlap=0)
    # NFKC turns "？！：；" into "?!:;"; the colon does not end a sentence, the quote stays with "。".
    assert [c.text for c in chunks] == [
        "你好吗?我很好!他说:“走吧。”", "我们走了;天黑了。你好吗?我很好!", "他说:“走吧。”我们走了;天黑了。",
        "你好吗?我很好!他说:“走吧。”", "我们走了;天黑了。",
    ]


def test_chunk_pages_across_three_pages() -> None:
    pages = [Page(p, " ".join(f"Page {p} says sentence number {s}." for s in range(1, 13))) for p in (1, 2, 3)]
    chunks = chunk_pages(pages, size=150, overlap=40)
    sentence = re.compile(r"Page (\d) says sentence number (\d+)\.")
    previous: list[tuple[str, str]] = []
    seen: list[tuple[str, str]] = []
    for chunk in chunks:
        assert len(chunk.text) <= 150
        found = sentence.findall(chunk.text)
        assert re.sub(r"\s+", " ", chunk.text) == " ".join(f"Page {p} says sentence number {s}." for p, s in found)
        new = [f for f in found if f not in previous]
        assert new and found[-len(new):] == new  # overlap first, then new sentences
        assert chunk.page == int(new[0][0])
        seen += new
        previous = found
    assert seen == [(str(p), str(s)) for p in (1, 2, 3) for s in range(1, 13)]
    assert {c.page for c in chunks} == {1, 2, 3}
    assert any(len({p for p, _ in sentence.findall(c.text)}) == 2 for c in chunks)  # chunks span pages


def test_paragraphs_are_kept_together_when_they_fit() -> None:
    first = " ".join(f"Intro sentence {n}." for n in range(1, 16))  # ~270 chars
    second = " ".join(f"Body sentence {n}." for n in range(1, 12))  # ~190 chars
    chunks = chunk_pages([Page(1, first + "\n\n" + second)], size=300, overlap=0)
    assert [c.text for c in chunks] == [first, second]


def test_overlap_repeats_trailing_whole_sentences() -> None:
    text = " ".join(f"Sentence number {n:02d} is here." for n in range(1, 41))  # 25 chars each
    chunks = chunk_pages([Page(1, text)], size=200, overlap=60)
    for previous, chunk in zip(chunks, chunks[1:]):
        tail = " ".join(previous.text.split(" ")[-10:])  # two whole sentences, 51 chars
        assert chunk.text.startswith(tail + " ")


def test_long_sentence_is_hard_split_at_spaces() -> None:
    long_sentence = " ".join(["word"] * 500) + "."
    chunks = chunk_pages([Page(1, "Short one. " + long_sentence + " Short two.")], size=200, overlap=20)
    assert all(0 < len(c.text) <= 200 for c in chunks)
    assert all(not c.text.startswith(" ") and "wor d" not in c.text for c in chunks)
    assert chunks[0].text.startswith("Short one.") and chunks[-1].text.endswith("Short two.")


def test_text_without_spaces_is_hard_split() -> None:
    chunks = chunk_pages([Page(4, "字" * 1050)], size=400, overlap=50)
    assert [len(c.text) for c in chunks] == [400, 400, 250]
    assert {c.page for c in chunks} == {4}


def test_chunk_pages_skips_empty_pages_and_never_emits_blank_chunks() -> None:
    pages = [Page(1, "  \n "), Page(2, ""), Page(3, "Only text. On page three.", None), Page(4, "\x00\n\t")]
    assert chunk_pages(pages) == [Chunk(0, 3, "Only text. On page three.")]
    assert chunk_pages([]) == []


def test_chunk_pages_is_the_same_in_every_process() -> None:
    """A document ingested again (a retried activity, another worker) must give the same chunks: their
    point ids are derived from their positions, so re-indexing overwrites instead of adding. Two
    processes with different hash seeds chunk the same pages."""
    script = ("import hashlib, sys; from ragline.text import Page, chunk_pages; "
              "pages = [Page(n, f'Paragraph {n}. ' * 40 + '\\n\\n' + '第二段。' * 50) for n in range(1, 4)]; "
              "sys.stdout.write(hashlib.sha256(repr(chunk_pages(pages, size=300, overlap=50)).encode()).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent.parent,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(digests) == 1 and len(next(iter(digests))) == 64


@pytest.mark.parametrize("question, follows_up", [
    ("And what caused it?", True), ("Who watches them?", True), ("What about the backups?", True),
    ("它的原因是什么？", True), ("What is the capital of Australia?", False), ("澳大利亚的首都是哪里？", False),
    ("How many orders failed?", False)])
def test_a_question_that_points_back_is_told_from_one_that_stands_alone(question, follows_up):
    from ragline.lexical import refers_back

    assert refers_back(question) is follows_up


@pytest.mark.parametrize("asked, written", [("Here's", "Heres"), ("don\u2019t", "dont"), ("John's car", "Johns car")])
def test_a_word_with_an_apostrophe_is_the_term_written_without_one(asked, written):
    from ragline.lexical import terms

    assert terms(asked) == terms(written) and terms(asked)
