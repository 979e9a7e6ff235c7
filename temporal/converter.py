"""The data converter shared by the API and the worker.

pydantic models travel as JSON. Any payload over `LARGE_PAYLOAD_BYTES` is swapped for a reference
into the blob store by the SDK's own claim-check mechanism (`ExternalStorage`), so an unexpectedly
large result can never push a workflow history towards Temporal's 2 MB payload limit. Documents and
chunk text do not rely on this safety net: activities pass explicit blob references.

With RAGLINE_ENCRYPT_PAYLOADS (the default) every payload is first encrypted with AES-256-GCM
(temporal/codec.py); a payload moved to the blob store is stored encrypted too. Failure messages and
stack traces are then moved into the failure's encoded attributes, a payload the codec encrypts: they hold
free text (a reviewer's comment, an operator's discard reason, a provider's error), which Temporal would
otherwise keep in plaintext and show in its Web UI. The raw failure's `message` reads "Encoded failure";
read one through `api.job_views.failure_message`. An Update validator's refusal stays plain (never stored).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

from temporalio.api.common.v1 import Payload
from temporalio.api.failure.v1 import Failure
from temporalio.contrib.pydantic import PydanticPayloadConverter, pydantic_data_converter
from temporalio.converter import (
    DataConverter,
    DefaultFailureConverter,
    EncodingPayloadConverter,
    ExternalStorage,
    PayloadConverter,
    StorageDriver,
    StorageDriverClaim,
    StorageDriverRetrieveContext,
    StorageDriverStoreContext,
)
from temporalio.exceptions import ApplicationError

from ragline.blobstore import BlobStore
from ragline.settings import Settings

LARGE_PAYLOAD_BYTES = 64 * 1024
# What the codec marks a payload that came in plain (temporal/codec.py): no converter reads it as what it says.
UNENCRYPTED_ENCODING = "ragline/unencrypted"
NOT_ENCRYPTED = "NotEncrypted"

# The failure types an Update validator refuses a decision with (workflows/review.py, dead_letters.py),
# and only there. Temporal records no refused Update in a history, and the Web UI's Send an Update
# dialog shows a refusal's message without decoding it: these stay plain, so a person who typed a wrong
# decision there reads what is wrong rather than "Encoded failure".
UPDATE_REFUSALS = frozenset({"InvalidReview", "NotWaitingForReview", "NotDeadLettered"})
# ... and the refusal of an input that came unencrypted: its sender has no codec to read it with.
PLAIN_FAILURES = UPDATE_REFUSALS | {NOT_ENCRYPTED}


class _ArrivedUnencrypted(EncodingPayloadConverter):
    """Refuses a payload that came in plain (a decision sent with the `temporal` CLI without its codec
    flags) with what to do, where the SDK would fail on an unknown encoding ("KeyError")."""

    encoding = UNENCRYPTED_ENCODING

    def to_payload(self, value: Any) -> Payload | None:
        return None  # never writes one

    def from_payload(self, payload: Payload, type_hint: type | None = None) -> Any:
        raise ApplicationError(
            "this input came unencrypted, and Ragline reads only payloads its codec encrypted: send it with the "
            "codec flags (`--codec-endpoint http://<api>/codec --codec-auth 'Bearer <an operator key>'`)",
            type=NOT_ENCRYPTED, non_retryable=True)


class RaglinePayloadConverter(PydanticPayloadConverter):
    """pydantic's JSON converters, and a clear refusal of a payload that came unencrypted."""

    def __init__(self) -> None:
        super().__init__()
        self._set_converters(*self.converters.values(), _ArrivedUnencrypted())


class EncodedFailureConverter(DefaultFailureConverter):
    """The SDK's failure converter with encoded attributes (a failure's message and stack trace move into
    a payload the codec encrypts), but for an Update validator's refusal and an input refused as unencrypted
    (`PLAIN_FAILURES`)."""

    def __init__(self) -> None:
        super().__init__(encode_common_attributes=True)
        self._plain = DefaultFailureConverter()

    def to_failure(self, exception: BaseException, payload_converter: PayloadConverter, failure: Failure) -> None:
        if isinstance(exception, ApplicationError) and exception.type in PLAIN_FAILURES:
            self._plain.to_failure(exception, payload_converter, failure)
        else:
            super().to_failure(exception, payload_converter, failure)


class BlobStoreDriver(StorageDriver):
    """Keeps oversized payloads as content-addressed blobs in the data folder."""

    def __init__(self, store: BlobStore) -> None:
        self._blobs = store  # not `self.store`: that would hide the driver's own store() from the SDK

    def name(self) -> str:
        return "ragline-blobs"

    async def store(self, context: StorageDriverStoreContext, payloads: Sequence[Payload]) -> list[StorageDriverClaim]:
        refs = await asyncio.to_thread(lambda: [self._blobs.put(p.SerializeToString()) for p in payloads])
        return [StorageDriverClaim(claim_data={"ref": ref}) for ref in refs]

    async def retrieve(self, context: StorageDriverRetrieveContext, claims: Sequence[StorageDriverClaim]) -> list[Payload]:
        blobs = await asyncio.to_thread(lambda: [self._blobs.get(c.claim_data["ref"]) for c in claims])
        payloads = []
        for blob in blobs:
            payload = Payload()
            payload.ParseFromString(blob)
            payloads.append(payload)
        return payloads


def build_data_converter(settings: Settings) -> DataConverter:
    """The one data converter: API, worker and tests all use it (through temporal.client.connect)."""
    codec = None
    failures: type[DefaultFailureConverter] = DefaultFailureConverter
    if settings.encrypt_payloads:
        from temporal.codec import EncryptionCodec, KeysFile  # never from workflow code (sandbox)

        codec = EncryptionCodec(KeysFile(settings.effective_codec_keys_file))
        # Without it a failure's message and stack trace stay plain text beside the encrypted payloads.
        failures = EncodedFailureConverter
    return dataclasses.replace(
        pydantic_data_converter,
        payload_converter_class=RaglinePayloadConverter,
        payload_codec=codec,
        failure_converter_class=failures,
        external_storage=ExternalStorage(drivers=[BlobStoreDriver(BlobStore(settings.blob_dir))],
                                         payload_size_threshold=LARGE_PAYLOAD_BYTES),
    )
