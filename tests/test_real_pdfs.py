"""Every real-world PDF in ../shared/pdfs, uploaded in one batch, gives what its README promises."""

from __future__ import annotations

import hashlib

from tests.conftest import SHARED_PDFS, shared_pdf

NO_TEXT = {"git.pdf", "two-different-pages.pdf", "form.pdf", "metadata.pdf", "issue-297.pdf"}
PASSWORD_REQUIRED = {
    "encrypted-file.pdf", "libreoffice-writer-password.pdf", "crazyones-encrypted-256.pdf",
    "encryption/r2-user-password.pdf", "encryption/r3-user-password.pdf", "encryption/r4-user-password.pdf",
    "encryption/r4-aes-user-password.pdf", "encryption/r6-both-passwords.pdf",
}
QPDF_USER_PASSWORD = "asdfzxcv"


async def test_every_shared_pdf_gives_its_documented_outcome(stack):
    shared_pdf("README.md")
    paths = sorted(p for p in SHARED_PDFS.rglob("*.pdf"))
    names = {str(p.relative_to(SHARED_PDFS)) for p in paths}
    assert NO_TEXT | PASSWORD_REQUIRED <= names

    files, name_of_hash = [], {}
    for path in paths:
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest in name_of_hash:
            continue  # identical bytes (hello-world.pdf == multilang.pdf) are one document
        name = str(path.relative_to(SHARED_PDFS))
        name_of_hash[digest] = name
        files.append((name.replace("/", "__"), data))
    body = await stack.upload(*files, collection="realpdfs")
    job = await stack.wait_job(body["job_id"], timeout=400)
    assert job["status"] == "completed", job

    outcomes = {o["filename"].replace("__", "/"): o for o in job["result"]["documents"]}
    assert set(outcomes) == set(name_of_hash.values())
    for name, outcome in outcomes.items():
        if name in NO_TEXT:
            assert outcome["status"] == "failed" and outcome["error"].startswith("no extractable text"), name
        elif name in PASSWORD_REQUIRED:
            assert outcome["status"] == "failed" and outcome["error"] == "encrypted: password required", name
        else:
            assert outcome["status"] == "indexed" and outcome["chunks"] >= 1, (name, outcome)

    hits = await stack.search("Vicksburg siege", collection="realpdfs", top_k=3)
    assert hits[0]["filename"] == "Seige_of_Vicksburg_Sample_OCR.pdf"
    multilang = await stack.search("Здравствуйте мир", collection="realpdfs", top_k=5)
    assert any(any("\u0400" <= ch <= "\u04ff" for ch in h["text"]) for h in multilang), "Cyrillic text was lost"


async def test_user_passwords_open_the_qpdf_encrypted_files(stack):
    names = ["encryption/r2-user-password.pdf", "encryption/r3-user-password.pdf",
             "encryption/r4-user-password.pdf", "encryption/r4-aes-user-password.pdf"]
    files = [(n.split("/")[-1], shared_pdf(n).read_bytes()) for n in names]
    body = await stack.upload(*files, collection="qpdf", password=QPDF_USER_PASSWORD)
    job = await stack.wait_job(body["job_id"])
    assert job["status"] == "completed"
    assert {o["status"] for o in job["result"]["documents"]} == {"indexed"}

    both = await stack.upload(("both.pdf", shared_pdf("encryption/r6-both-passwords.pdf").read_bytes()),
                              collection="qpdf", password="bar")
    assert (await stack.wait_job(both["job_id"]))["status"] == "completed"
