"""Enqueue answers as bytes: the repeated `EnqueueResult` of `EnqueueBatchResponse` and
`StreamEnqueueResponse`, encoded by hand.

Building one `EnqueueResult` object per message and serializing the response was the
largest single item of the edge's per-message work under batched enqueue, several
times what concatenating bytes costs. Errors go through protobuf once per distinct
error in an answer (its class and message): a request refused whole, or many items
naming one missing queue, cost one encoding.

An answer is encoded as soon as its results are known, and only its bytes are kept
until it is written: a failed item's exception (with its traceback) is not held
while the answer waits for its commit or for a client that does not read.
"""

from __future__ import annotations

from collections.abc import Sequence

from fila.cluster.errors import RemoteError
from fila.core.enqueue import ItemResult
from fila.core.errors import BrokerError
from fila.core.frames import varint
from fila.server.status import error_fields
from fila.v1 import service_pb2

# EnqueueBatchResponse.results = 1, StreamEnqueueResponse.results = 2 (length-delimited)
BATCH_RESULTS_TAG = b"\x0a"
STREAM_RESULTS_TAG = b"\x12"
_SEQUENCE_TAG = b"\x08"  # StreamEnqueueResponse.sequence_number = 1 (varint)
# An EnqueueResult{message_id} of a 36-character id: field 1, 38 bytes; inside, field 1.
_ID_RESULT = b"\x26\x0a\x24"
# What one stored message adds to an answer: its tag, length and EnqueueResult.
ID_RESULT_BYTES = 1 + len(_ID_RESULT) + 36


def encode_results(results: Sequence[ItemResult], tag: bytes) -> bytes:
    """The repeated `EnqueueResult` field of a batch answer (see the module docstring)."""
    parts: list[bytes] = []
    errors: dict[object, bytes] = {}  # items failing alike share their bytes
    for result in results:
        if isinstance(result, BrokerError):
            # A BrokerError's class and message decide its BatchError; a RemoteError
            # carries the code and kind another node answered with.
            key = (
                error_fields(result)
                if isinstance(result, RemoteError)
                else (
                    type(result),
                    result.args,
                )
            )
            framed = errors.get(key)
            if framed is None:
                body = error_result(result)
                framed = errors[key] = tag + varint(len(body)) + body
            parts.append(framed)
        else:
            parts += (tag, _ID_RESULT, result.encode())
    return b"".join(parts)


def stream_answer(sequence: int, results: Sequence[ItemResult]) -> bytes:
    """An encoded `StreamEnqueueResponse`."""
    return _SEQUENCE_TAG + varint(sequence) + encode_results(results, STREAM_RESULTS_TAG)


def error_result(exc: Exception) -> bytes:
    """An encoded `EnqueueResult` carrying `exc` as its `BatchError`."""
    return _error_body(*error_fields(exc))


def _error_body(code: int, kind: str, message: str) -> bytes:
    error = service_pb2.BatchError(code=code, kind=kind, message=message)
    return service_pb2.EnqueueResult(error=error).SerializeToString()


def stream_answer_of(sequence: int, bodies: Sequence[bytes]) -> bytes:
    """An encoded `StreamEnqueueResponse` from encoded `EnqueueResult`s."""
    parts = [_SEQUENCE_TAG, varint(sequence)]
    for body in bodies:
        parts += (STREAM_RESULTS_TAG, varint(len(body)), body)
    return b"".join(parts)
