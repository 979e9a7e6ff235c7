"""Turning uploaded bytes into clean text and chunks: sniffing, PDF/text extraction, normalisation.

Pure functions over bytes and strings; no Temporal, no files. Every way an upload can be
unusable ends in `InputError` with a message a person can act on:
"encrypted: password required", "encrypted: wrong password", "corrupt PDF: <reason>",
"too many pages: N > MAX", "no extractable text (...)", "not valid UTF-8 text",
"unsupported file type: ...".
"""

from __future__ import annotations

import codecs
import re
import unicodedata
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from io import BytesIO
from typing import Literal

from pypdf import PasswordType, PdfReader
from pypdf.errors import DependencyError

from ragline.errors import InputError

__all__ = [
    "Chunk",
    "Page",
    "check_has_text",
    "chunk_pages",
    "count_text_chars",
    "extract_pages",
    "normalize",
    "sniff_kind",
]


@dataclass(frozen=True)
class Page:
    number: int  # 1-based
    text: str
    # Why this page could not be read (its text is then ""); None for a page that was read.
    error: str | None = None


@dataclass(frozen=True)
class Chunk:
    index: int  # 0-based, in document order
    page: int  # page where the chunk's first new (non-overlap) text starts
    text: str


# ---------------------------------------------------------------------------------------------
# Sniffing

_PDF_MAGIC = b"%PDF-"
_PDF_MAGIC_WINDOW = 1024  # readers accept the header anywhere in the first KiB
_SNIFF_TEXT_BYTES = 8192
_ALLOWED_CONTROLS = frozenset("\t\n\r\f\v")
_MAX_CONTROL_RATIO = 0.01
# Why an encrypted PDF was not read: another upload of it with a password of its own tries that one.
WRONG_PASSWORD = "encrypted: wrong password"
PASSWORD_REQUIRED = "encrypted: password required"


def sniff_kind(head: bytes) -> Literal["pdf", "text"] | None:
    """What the first bytes of an upload are, regardless of its name: "pdf", "text" or None.

    Empty input counts as text, so that it fails later as "no extractable text". The PDF header counts
    where it starts the file, or later in the first KiB (readers accept some junk before it) when the file
    is not text: a note that quotes "%PDF-1.7" in its first lines is a note.
    """
    at = head.find(_PDF_MAGIC, 0, _PDF_MAGIC_WINDOW)
    text = _is_text(head)
    if at != -1 and (not head[:at].lstrip(codecs.BOM_UTF8).strip() or not text):
        return "pdf"
    return "text" if text else None


def _is_text(head: bytes) -> bool:
    sample = head[:_SNIFF_TEXT_BYTES]
    if sample.startswith(codecs.BOM_UTF8):
        sample = sample[len(codecs.BOM_UTF8):]
    if b"\x00" in sample:
        return False
    try:
        # Not final: the head may end in the middle of a multi-byte character.
        text = codecs.getincrementaldecoder("utf-8")().decode(sample, final=False)
    except UnicodeDecodeError:
        return False
    controls = sum(1 for c in text if unicodedata.category(c) == "Cc" and c not in _ALLOWED_CONTROLS)
    return controls <= len(text) * _MAX_CONTROL_RATIO


# ---------------------------------------------------------------------------------------------
# Extraction

_SURROGATES = re.compile(r"[\ud800-\udfff]")


def extract_pages(
    data: bytes,
    kind: str,
    *,
    password: str | None = None,
    max_pages: int = 500,
    on_page: Callable[[int, int], None] | None = None,
) -> list[Page]:
    """The raw text of every page (not yet normalised). `on_page(number, total)` runs after each page.

    For PDFs a page that cannot be read is returned with `error` set and empty text; if no page
    can be read the document is corrupt. A password is only needed, and only checked, when the
    document cannot be opened without one.
    """
    if kind == "pdf":
        return _extract_pdf(data, password, max_pages, on_page)
    if kind == "text":
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise InputError("not valid UTF-8 text", details={"offset": exc.start}) from None
        if on_page:
            on_page(1, 1)
        return [Page(1, text)]
    raise InputError(f"unsupported file type: {kind or 'not a PDF or UTF-8 text'}")


def _reason(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    reason = lines[0].strip() if lines else type(exc).__name__
    return reason if len(reason) <= 100 else reason[:99] + "…"


def _corrupt(exc: BaseException) -> InputError:
    return InputError(f"corrupt PDF: {_reason(exc)}", details={"error": type(exc).__name__})


def _open_pdf(data: bytes, password: str | None) -> PdfReader:
    # pypdf raises arbitrary exception types on hostile input (KeyError, ValueError, RecursionError,
    # zlib errors...), hence the broad catches. DependencyError is our deployment's fault, not the
    # document's, so it must not be reported as bad input.
    try:
        reader = PdfReader(BytesIO(data))
    except DependencyError:
        raise
    except NotImplementedError as exc:
        raise InputError(f"encrypted: unsupported encryption ({exc})") from None
    except Exception as exc:
        raise _corrupt(exc) from None
    if not reader.is_encrypted:
        return reader
    # The empty password opens documents that only restrict printing/copying; such a document
    # is readable whatever password was typed, so it is tried after the given one.
    for candidate in ([password] if password else []) + [""]:
        try:
            if reader.decrypt(candidate) != PasswordType.NOT_DECRYPTED:
                return reader
        except DependencyError:
            raise
        except Exception as exc:
            raise _corrupt(exc) from None
    raise InputError(WRONG_PASSWORD if password else PASSWORD_REQUIRED)


def _count_pages(reader: PdfReader) -> int:
    try:
        found = len(reader.pages)
    except DependencyError:
        raise
    except Exception as exc:
        raise _corrupt(exc) from None
    if found == 0:
        raise InputError("corrupt PDF: no pages found")
    try:
        declared = int(reader.root_object["/Pages"].get_object()["/Count"])
    except Exception:
        declared = found  # an unreadable /Count is only a failed sanity check
    # pypdf silently drops pages whose objects are damaged; a user would not expect half a book.
    if declared > found:
        raise InputError(
            f"corrupt PDF: page tree damaged ({found} of {declared} pages found)",
            details={"found": found, "declared": declared},
        )
    return found


def _extract_pdf(
    data: bytes, password: str | None, max_pages: int, on_page: Callable[[int, int], None] | None
) -> list[Page]:
    reader = _open_pdf(data, password)
    total = _count_pages(reader)
    if total > max_pages:
        raise InputError(f"too many pages: {total} > {max_pages}", details={"pages": total, "max_pages": max_pages})
    pages: list[Page] = []
    for number in range(1, total + 1):
        try:
            text = reader.pages[number - 1].extract_text()
        except DependencyError:
            raise
        except Exception as exc:
            pages.append(Page(number, "", error=_reason(exc)))
        else:
            pages.append(Page(number, _SURROGATES.sub("", text or "")))
        if on_page:
            on_page(number, total)
    if all(page.error for page in pages):
        raise InputError(
            f"corrupt PDF: no page could be read ({pages[0].error})", details={"pages": total}
        )
    return pages


# ---------------------------------------------------------------------------------------------
# Normalisation

# Han, kana, bopomofo, CJK symbols/punctuation, full/half-width forms. Hangul is left out on
# purpose: Korean separates words with spaces, so its line breaks are spaces too.
_CJK = (
    "\u2e80-\u2fdf\u3000-\u303f\u3040-\u30ff\u3100-\u312f\u3190-\u31ff\u3400-\u4dbf"
    "\u4e00-\u9fff\uf900-\ufaff\ufe30-\ufe4f\uff00-\uffef\U00020000-\U0003134f"
)
_PARAGRAPH_BREAKS = re.compile("\f|\u2029")
_LINE_BREAKS = re.compile("\r\n|[\r\v\x85\u2028]")
# Soft hyphens at a line end are hyphenation; elsewhere they and zero-width spaces are invisible.
_SOFT_HYPHEN_EOL = re.compile("\u00ad[^\\S\n]*\n[^\\S\n]*")
_INVISIBLE = re.compile("[\u00ad\u200b\u2060\ufeff]")
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
_SPACES = re.compile(r"[^\S\n]+")
_SPACES_AROUND_NEWLINE = re.compile(r" ?\n ?")
_BLANK_LINES = re.compile(r"\n{2,}")
_HYPHENATED = re.compile(r"(?<=[^\W_])-\n(?=\w)")
_CJK_NEWLINE = re.compile(rf"(?:(?<=[{_CJK}])|(?<=[{_CJK}][^\w\s]))\n(?=[^\w\s]?[{_CJK}])")


def normalize(text: str) -> str:
    """Clean extracted text: NFKC, joined hyphenation, unwrapped lines, "\\n\\n" between paragraphs."""
    text = _PARAGRAPH_BREAKS.sub("\n\n", _LINE_BREAKS.sub("\n", text))
    text = unicodedata.normalize("NFKC", text)
    text = _INVISIBLE.sub("", _SOFT_HYPHEN_EOL.sub("", text))
    text = _CONTROLS.sub("", text)
    text = _SPACES_AROUND_NEWLINE.sub("\n", _SPACES.sub(" ", text))
    paragraphs = (_unwrap(p) for p in _BLANK_LINES.split(text.strip()))
    return "\n\n".join(p for p in paragraphs if p)


def _unwrap(paragraph: str) -> str:
    paragraph = _HYPHENATED.sub(_join_hyphenated, paragraph)
    paragraph = _CJK_NEWLINE.sub("", paragraph)
    return paragraph.replace("\n", " ").strip()


def _join_hyphenated(match: re.Match[str]) -> str:
    # "exam-\nple" is one word split by the layout; "COVID-\n19" or "Jean-\nPaul" keep the hyphen.
    before, after = match.string[match.start() - 1], match.string[match.end()]
    return "" if before.isalpha() and after.islower() else "-"


def count_text_chars(pages: Iterable[Page]) -> int:
    """Non-whitespace characters of all pages after normalisation."""
    return sum(1 for page in pages for c in normalize(page.text) if not c.isspace())


def check_has_text(pages: list[Page], min_text_chars: int) -> None:
    found = count_text_chars(pages)
    if found < min_text_chars:
        raise InputError(
            f"no extractable text ({found} characters; at least {min_text_chars} needed)",
            details={"characters": found, "min_text_chars": min_text_chars},
        )


# ---------------------------------------------------------------------------------------------
# Chunking

_CJK_TERMINATORS = "。！？；"
_LATIN_TERMINATORS = ".!?"
_CLOSERS = "\"'”’»」』）)\\]】》〉"
_SENTENCE_END = re.compile(rf"[{_CJK_TERMINATORS}{_LATIN_TERMINATORS};]+[{_CLOSERS}]*")
_CJK_CHAR = re.compile(rf"[{_CJK}]")
_PARAGRAPH_SEP = "\n\n"
# A last sentence somewhat longer than `overlap` is still worth repeating ("about" overlap).
_OVERLAP_SLACK = 1.5


@dataclass(frozen=True)
class _Unit:
    page: int
    text: str
    sep: str  # joins it to the unit before: "" or " " inside a paragraph, "\n\n" between paragraphs


def chunk_pages(pages: list[Page], *, size: int = 800, overlap: int = 120) -> list[Chunk]:
    """Split normalised pages into chunks of at most `size` characters.

    Chunk boundaries fall between paragraphs when that does not leave a chunk less than half
    full, otherwise between sentences; only a sentence longer than `size` is cut inside. Each
    chunk after the first starts by repeating the previous chunk's last whole sentences, about
    `overlap` characters of them. Pages are joined like paragraphs.
    """
    if size <= 0 or overlap < 0:
        raise ValueError(f"need size > 0 and overlap >= 0, got size={size}, overlap={overlap}")
    chunks: list[Chunk] = []
    body: list[_Unit] = []  # the chunk being built
    repeated = 0  # body[:repeated] is overlap carried over from the previous chunk
    length = 0  # == _length(body), kept incrementally

    def emit() -> None:
        nonlocal body, repeated, length
        chunks.append(Chunk(len(chunks), body[repeated].page, _join(body)))
        body = _overlap_tail(body, overlap)
        repeated, length = len(body), _length(body)

    for paragraph in _paragraph_units(pages, size):
        paragraph_length = _length(paragraph)
        if (len(body) > repeated and length >= size // 2
                and length + len(_PARAGRAPH_SEP) + paragraph_length > size >= paragraph_length):
            emit()
        for unit in paragraph:
            if len(body) > repeated and length + len(unit.sep) + len(unit.text) > size:
                emit()
            while repeated and length + len(unit.sep) + len(unit.text) > size:
                body, repeated = body[1:], repeated - 1
                length = _length(body)
            length += (len(unit.sep) if body else 0) + len(unit.text)
            body.append(unit)
    if len(body) > repeated:
        emit()
    return chunks


def _paragraph_units(pages: list[Page], size: int) -> Iterable[list[_Unit]]:
    for page in pages:
        for paragraph in normalize(page.text).split(_PARAGRAPH_SEP):
            units = [
                _Unit(page.number, piece, sep)
                for sentence, sentence_sep in _sentences(paragraph)
                for piece, sep in _hard_split(sentence, sentence_sep, size)
            ]
            if units:
                units[0] = _Unit(page.number, units[0].text, _PARAGRAPH_SEP)
                yield units


def _sentences(paragraph: str) -> list[tuple[str, str]]:
    """(sentence, separator before it) pairs; the separator is "" between CJK sentences."""
    result: list[tuple[str, str]] = []
    start = 0
    for match in _SENTENCE_END.finditer(paragraph):
        end = match.end()
        ending = match.group()
        before = paragraph[match.start() - 1] if match.start() else ""
        if any(c in _CJK_TERMINATORS for c in ending) or _CJK_CHAR.match(before):
            pass  # CJK sentences end at the mark (NFKC turns "！？；" into "!?;")
        elif any(c in _LATIN_TERMINATORS for c in ending):
            # A Latin sentence ends before a space and a word that is not lowercase ("e.g. this").
            following = paragraph[end:end + 2]
            if following and not (following[0] == " " and not following[1:].islower()):
                continue
        else:
            continue
        _add_sentence(result, paragraph, start, end)
        start = end
    _add_sentence(result, paragraph, start, len(paragraph))
    return result


def _add_sentence(result: list[tuple[str, str]], paragraph: str, start: int, end: int) -> None:
    sentence = paragraph[start:end].strip()
    if sentence:
        result.append((sentence, " " if paragraph[start:start + 1].isspace() else ""))


def _hard_split(sentence: str, sep: str, size: int) -> list[tuple[str, str]]:
    # Walks an offset: cutting the rest off as a new string each time made a text with no sentence end (a
    # CSV, a log) quadratic, tens of minutes for a 48 MB file, where the chunking step has 2.
    pieces = []
    pos, end = 0, len(sentence)
    while end - pos > size:
        cut = sentence.rfind(" ", pos, pos + size + 1)
        if cut - pos < size // 2:  # no usable space (CJK, URLs): cut mid-word rather than leave a stub
            pieces.append((sentence[pos:pos + size], sep))
            pos, sep = _past_spaces(sentence, pos + size), ""
        else:
            pieces.append((sentence[pos:cut], sep))
            pos, sep = _past_spaces(sentence, cut + 1), " "
    if pos < end:
        pieces.append((sentence[pos:], sep))
    return pieces


def _past_spaces(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _length(units: list[_Unit]) -> int:
    return sum(len(u.text) for u in units) + sum(len(u.sep) for u in units[1:])


def _join(units: list[_Unit]) -> str:
    return units[0].text + "".join(u.sep + u.text for u in units[1:])


def _overlap_tail(body: list[_Unit], overlap: int) -> list[_Unit]:
    """The trailing whole units of `body` worth repeating; never all of it."""
    if overlap <= 0 or len(body) < 2:
        return []
    count, length = 0, 0
    while count < len(body) - 1:
        unit = body[-(count + 1)]
        grown = length + len(unit.text) + (len(body[-count].sep) if count else 0)
        if grown > overlap:
            break
        count, length = count + 1, grown
    if count == 0 and len(body[-1].text) <= overlap * _OVERLAP_SLACK:
        count = 1
    return body[len(body) - count:]
