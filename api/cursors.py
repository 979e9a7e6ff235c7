"""Listing cursors (`next_cursor`): Temporal's page token, signed, so that only a cursor this deployment
gave, for the same query, ever reaches Temporal.

A cursor is base64url(tag + token), tag = HMAC-SHA256(cursor key, query, token) cut to TAG_BYTES. The
query holds the tenant and the filters, so a cursor of another listing or tenant is refused like a
made-up one: 422 `invalid_cursor`, without a call to Temporal (which fails slowly on a token it did not
make, with errors the client retries until its RPC timeout).

The cursor key is derived from the payload keys (temporal/codec.py): every API process of a deployment
already shares that file, so a cursor one process gave works on any other behind the load balancer. The
file is read for this even with RAGLINE_ENCRYPT_PAYLOADS=false (created like the codec creates it, when
missing). The derivation is an HMAC of a fixed label under the payload key, so the payload key itself
never signs anything. New cursors are signed with the current key's derivative and every key's is
accepted: a cursor given just before a rotation still pages after it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Sequence
from pathlib import Path

from api.errors import ApiError
from temporal.codec import CodecKeys, KeysFile

# Names this use of the payload keys: another use derives with its own label and gets another key.
LABEL = b"ragline/listing-cursor/v1"
# 128 bits: no guessing, and a cursor stays short (22 base64 characters besides the token).
TAG_BYTES = 16


def derived_key(payload_key: bytes, label: bytes) -> bytes:
    """A key for one use (`label`) derived from a payload key, which itself never signs anything."""
    return hmac.new(payload_key, label, hashlib.sha256).digest()


def cursor_key(payload_key: bytes) -> bytes:
    return derived_key(payload_key, LABEL)


def invalid_cursor() -> ApiError:
    return ApiError(422, "invalid_cursor", "cursor is not a next_cursor this listing gave (with the same filters)")


class CursorSigner:
    def __init__(self, keys: Sequence[bytes], source: KeysFile | None = None) -> None:
        """`keys`: cursor keys, the one that signs first; any of them verifies. With `source`, a cursor no key
        verifies is checked again once the keys file has changed (another API process rotated it)."""
        if not keys:
            raise ValueError("a cursor signer needs at least one key")
        self._keys = list(keys)
        self._source = source

    @staticmethod
    def _derived(codec_keys: CodecKeys) -> list[bytes]:
        current = codec_keys.keys[codec_keys.current]
        others = [raw for key_id, raw in codec_keys.keys.items() if key_id != codec_keys.current]
        return [cursor_key(raw) for raw in (current, *others)]

    @classmethod
    def from_codec_keys(cls, codec_keys: CodecKeys) -> CursorSigner:
        return cls(cls._derived(codec_keys))

    @classmethod
    def for_deployment(cls, codec_keys_file: Path) -> CursorSigner:
        source = KeysFile(codec_keys_file)
        return cls(cls._derived(source.keys), source)

    def encode(self, query: str, token: bytes) -> str:
        """Opaque to the client; valid only with the same query (tenant and filters)."""
        if self._source is not None and self._source.refresh_due():  # rotated: sign with the new current key
            self._keys = self._derived(self._source.keys)
        return base64.urlsafe_b64encode(_tag(self._keys[0], query, token) + token).decode().rstrip("=")

    def decode(self, query: str, cursor: str) -> bytes:
        """Temporal's page token, or 422 invalid_cursor for anything this deployment did not sign for `query`."""
        try:
            raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        except (ValueError, binascii.Error):
            raise invalid_cursor() from None
        tag, token = raw[:TAG_BYTES], raw[TAG_BYTES:]
        if not token:
            raise invalid_cursor()
        if not self._signed(tag, query, token):
            if self._source is None or not self._source.refresh():
                raise invalid_cursor()
            self._keys = self._derived(self._source.keys)  # rotated since: signs with the new key from now on
            if not self._signed(tag, query, token):
                raise invalid_cursor()
        return token

    def _signed(self, tag: bytes, query: str, token: bytes) -> bool:
        return any(hmac.compare_digest(tag, _tag(key, query, token)) for key in self._keys)


def _tag(key: bytes, query: str, token: bytes) -> bytes:
    # The query's length first: (query, token) pairs that concatenate alike must not share a tag.
    encoded = query.encode()
    message = len(encoded).to_bytes(4, "big") + encoded + token
    return hmac.new(key, message, hashlib.sha256).digest()[:TAG_BYTES]


class PasswordTags:
    """A tag of an upload's password for its job id: the same files re-sent with another password (the right
    one, while the first upload still waits to run) are another upload, not a duplicate of the first. Keyed,
    so the id that a tenant's members see tells nothing about the password."""

    LABEL = b"ragline/upload-password/v1"

    def __init__(self, payload_key: bytes) -> None:
        self._key = derived_key(payload_key, self.LABEL)

    @classmethod
    def for_deployment(cls, codec_keys_file: Path) -> PasswordTags:
        # The oldest key (ids are the times they were made), not the current one: a rotation leaves it, so API
        # processes started before and after one give a re-sent upload the same id. Only dropping that key
        # changes the tags (a re-sent upload is then another job; its documents still run once).
        keys = KeysFile(codec_keys_file).keys
        return cls(keys.keys[min(keys.keys)])

    def tag(self, password: str | None) -> str:
        return hmac.new(self._key, password.encode(), hashlib.sha256).hexdigest()[:16] if password else ""
