"""Listing cursors are signed with a key derived from the deployment's payload keys (api/cursors.py):
no Temporal needed to check what they accept."""

from __future__ import annotations

import pytest

from api.cursors import CursorSigner, PasswordTags
from api.errors import ApiError
from temporal import codec

QUERY = "RaglineTenant = 'acme' AND RaglineJobKind IN ('ingest')"
TOKEN = b"temporal's page token"


def _refused(signer: CursorSigner, query: str, cursor: str) -> bool:
    with pytest.raises(ApiError) as refused:
        signer.decode(query, cursor)
    return (refused.value.status, refused.value.code) == (422, "invalid_cursor")


def test_a_cursor_pages_only_with_its_query_and_its_deployments_keys(tmp_path):
    signer = CursorSigner.for_deployment(tmp_path / "codec_keys.toml")
    cursor = signer.encode(QUERY, TOKEN)
    assert signer.decode(QUERY, cursor) == TOKEN
    assert len(cursor) <= (16 + len(TOKEN)) * 4 // 3 + 1  # the token and a 16-byte tag: short
    assert _refused(signer, QUERY.replace("acme", "globex"), cursor)
    assert _refused(CursorSigner.for_deployment(tmp_path / "another_deployment.toml"), QUERY, cursor)
    assert _refused(signer, QUERY, cursor[:22])  # a tag without a token


def test_processes_sharing_the_keys_file_take_each_others_cursors_across_a_rotation(tmp_path):
    """Every API process reads the same payload keys (with encryption off too: the file is created like
    the codec creates it), so a cursor of one process pages on another, before and after a rotation."""
    path = tmp_path / "codec_keys.toml"
    before = CursorSigner.for_deployment(path)
    assert CursorSigner.for_deployment(path).decode(QUERY, before.encode(QUERY, TOKEN)) == TOKEN
    codec.rotate(path)
    after = CursorSigner.for_deployment(path)
    assert after.decode(QUERY, before.encode(QUERY, TOKEN)) == TOKEN
    assert after.encode(QUERY, TOKEN) != before.encode(QUERY, TOKEN)  # the current key signs



def test_an_uploads_password_tag_is_the_deployments_and_tells_nothing_of_the_password(tmp_path):
    """The tag in an upload's job id: the same for the same password in every API process of a deployment,
    across a key rotation too (a re-sent upload is a duplicate), another for another password, and keyed:
    another deployment's keys give another tag (a guess cannot be checked against the id without the keys)."""
    tags = PasswordTags.for_deployment(tmp_path / "codec_keys.toml")
    assert tags.tag("password") == PasswordTags.for_deployment(tmp_path / "codec_keys.toml").tag("password")
    assert tags.tag("password") != tags.tag("passw0rd") and tags.tag(None) == tags.tag("") == ""
    assert tags.tag("password") != PasswordTags.for_deployment(tmp_path / "other.toml").tag("password")
    codec.rotate(tmp_path / "codec_keys.toml")  # a process started after a rotation tags as one started before
    assert PasswordTags.for_deployment(tmp_path / "codec_keys.toml").tag("password") == tags.tag("password")
