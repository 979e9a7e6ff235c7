"""Write small, valid PDFs from plain text, one string per page, with no dependencies.

Raw PDF syntax: one catalog, one page tree, the standard Helvetica font (no embedding needed)
and one uncompressed content stream per page, plus an exact cross-reference table, so pypdf
reads the result without any repair. Text is encoded as WinAnsi (cp1252); other characters
become "?".
"""

from __future__ import annotations

from pathlib import Path

_FONT_SIZE = 12
_LEADING = 14


def _pdf_string(line: str) -> bytes:
    raw = line.encode("cp1252", errors="replace")
    return b"(" + raw.replace(b"\\", b"\\\\").replace(b"(", b"\\(").replace(b")", b"\\)") + b")"


def _content(text: str) -> bytes:
    ops = [b"BT", b"/F1 %d Tf" % _FONT_SIZE, b"%d TL" % _LEADING, b"72 770 Td"]
    for i, line in enumerate(text.split("\n")):
        if i:
            ops.append(b"T*")
        if line:
            ops.append(_pdf_string(line) + b" Tj")
    ops.append(b"ET")
    return b"\n".join(ops)


def pdf_bytes(pages: list[str]) -> bytes:
    """A PDF with one page (US Letter) per string; "\\n" starts a new line."""
    n = len(pages)
    # Object numbers: 1 catalog, 2 page tree, 3 font, then (page, content) pairs.
    page_ids = [4 + 2 * i for i in range(n)]
    objects: list[bytes] = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [%s] /Count %d >>" % (b" ".join(b"%d 0 R" % p for p in page_ids), n),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>",
    ]
    for page_id, text in zip(page_ids, pages):
        stream = _content(text)
        objects.append(
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
            b"/Resources << /Font << /F1 3 0 R >> >> /Contents %d 0 R >>" % (page_id + 1)
        )
        objects.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream))

    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref_at = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref_at)
    return bytes(out)


def write_pdf(path: Path, pages: list[str]) -> Path:
    path.write_bytes(pdf_bytes(pages))
    return path
