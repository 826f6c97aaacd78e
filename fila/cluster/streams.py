"""StreamEnqueue on a cluster node: each request split by owner, answered in order.

A producer's stream may name queues on every node in one request. The node it
reached splits each request: the messages of its own queues go to its local
StreamEnqueue handler (fed as a stream of their own, so they share group commits as
on a single node), and the messages of each other node's queues go to that node over
one forwarding stream per node, opened on first use with the caller's credentials
and kept for the life of the producer's stream. Each request is answered once every
part of it is answered, with its results in request order, and requests are answered
in the order they came (as on a single node). A message whose owner is down, or whose
owner's stream fails, gets its error in its own result; the stream stays open. A node
counted down while parts are on their way to it (`fila.cluster.peers` cuts its channel)
fails those parts with OwnerDown at once, so the answers queued behind them go out.

A request's failure as a whole (over `server.max_batch_messages`) is its items' error,
as on a single node; a revoked key ends the stream with UNAUTHENTICATED at its next
request (`access.require_key`), as on a single node. An item the caller may not
produce to gets PERMISSION_DENIED here, before its queue is looked up, so a key with
no rights never makes this node ask etcd where a queue lives.

The splitter owes the producer the answers to every request it took, wherever their
parts went, so it holds the single node's bound (`fila.server.owed`): it reads no
further while the answers it owes reach `owed_bytes_bound`. A request is counted
from the moment it is taken as if each item will be stored (an id each), corrected
as its parts are answered, and kept, once complete, as its encoded answer only. The
local handler and the forwarding streams are fed only what the splitter took, so
neither grows on its own: a producer that does not read is held back by HTTP/2 flow
control as on a single node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeAlias, cast

import grpc
import grpc.aio

from fila.cluster.errors import OwnerDown
from fila.cluster.layout import NodeRecord
from fila.cluster.peers import Link, Peers, cut_off, is_forwarded, translate
from fila.cluster.routing import LOCAL, Router, Target
from fila.core.errors import BrokerError, InvalidArgument, Unavailable
from fila.server import access, rpc
from fila.server.access import Kind
from fila.server.owed import ANSWER_OVERHEAD_BYTES, OwedAnswers, owed_bytes_bound
from fila.server.readers import Interrupted, StreamReaders
from fila.server.results import ID_RESULT_BYTES, error_result, stream_answer, stream_answer_of
from fila.server.rpc import BadRequest
from fila.v1 import service_pb2

log = logging.getLogger("fila.cluster")

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
Inner = Callable[[AsyncIterator[Any], Context], Awaitable[None]]
METHOD = "/fila.v1.FilaService/StreamEnqueue"


class _Pending:
    """One request of the producer: its items' encoded results, filled in by its parts,
    then (`done`) its encoded answer. Counted in the stream's owed answers: `counted`
    bytes, first as if every item were stored, then as answered."""

    __slots__ = ("answer", "counted", "done", "missing", "owed", "results", "sequence")

    def __init__(self, sequence: int, size: int, owed: OwedAnswers[_Pending]) -> None:
        self.sequence = sequence
        self.results: list[bytes] = [b""] * size
        self.missing = 0
        self.answer = b""
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.owed = owed
        self.counted = ANSWER_OVERHEAD_BYTES + size * ID_RESULT_BYTES
        owed.put(self, self.counted)

    def fill(self, indexes: Sequence[int], results: Sequence[bytes]) -> None:
        """Encoded `EnqueueResult`s for the items at `indexes`: one part answered."""
        for index, result in zip(indexes, results, strict=False):
            self.results[index] = result
        self.recount(sum(map(len, results)) + 2 * len(results) - len(indexes) * ID_RESULT_BYTES)
        self.missing -= 1
        if self.missing == 0:
            self.complete(stream_answer_of(self.sequence, self.results))

    def fail(self, indexes: Sequence[int], error: Callable[[int], BrokerError]) -> None:
        self.fill(indexes, [error_result(error(i)) for i in indexes])

    def complete(self, answer: bytes) -> None:
        """The whole answer, encoded: only it is kept until written."""
        if self.done.done():
            return
        self.answer = answer
        self.results = []
        self.recount(ANSWER_OVERHEAD_BYTES + len(answer) - self.counted)
        self.done.set_result(None)

    def recount(self, delta: int) -> None:
        self.counted += delta
        self.owed.grew(delta)


# A part sent to the local handler: its request, its items, whether it is the whole one.
_Part = tuple[_Pending, list[int], bool]


class _CaptureContext:
    """The context the local handler sees: its answers come back here, everything
    else (abort, metadata, peer) is the producer's real context."""

    def __init__(self, real: Context, answer: Callable[[Any], None]) -> None:
        self._real = real
        self._answer = answer

    async def write(self, message: Any) -> None:
        self._answer(message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _Remote:
    """The forwarding stream to one node, and the parts it still owes answers for."""

    def __init__(
        self, node: NodeRecord, link: Link, call: grpc.aio.StreamStreamCall[bytes, bytes]
    ) -> None:
        self.node = node
        self.link = link
        self.call = call
        self.parts: dict[int, tuple[_Pending, list[int], list[str]]] = {}
        self.sequence = 0
        self.broken: BrokerError | None = None
        self.reader: asyncio.Task[None] | None = None


class StreamSplitter:
    def __init__(
        self,
        router: Router,
        peers: Peers,
        inner: Inner,
        context: Context,
        max_batch: int,
        readers: StreamReaders | None = None,
    ) -> None:
        self._router = router
        self._readers = readers or StreamReaders()
        self._peers = peers
        self._inner = inner
        self._context = context
        self._max_batch = max_batch
        self._forwarded = False
        self._order: deque[_Pending] = deque()
        self._written = asyncio.Event()
        self._local_in: asyncio.Queue[service_pb2.StreamEnqueueRequest | None] = asyncio.Queue()
        self._local_parts: deque[_Part] = deque()  # the local handler answers in order
        self._local_task: asyncio.Task[None] | None = None
        self._remotes: dict[int, _Remote] = {}
        self._owed: OwedAnswers[_Pending] = OwedAnswers(owed_bytes_bound(max_batch))

    async def run(self, requests: AsyncIterator[Any]) -> None:
        self._forwarded = is_forwarded(self._context)
        writer = asyncio.create_task(self._write_answers())
        stopping = False
        try:
            iterator = aiter(requests)
            while not writer.done():
                try:
                    with self._readers.reading():
                        if self._owed.full:
                            await self._owed.room()
                            if writer.done():
                                break
                        request = await anext(iterator)
                except StopAsyncIteration:
                    break
                except Interrupted:
                    stopping = True  # the broker stops: answer what was taken, then end
                    break
                if isinstance(request, BadRequest):
                    await rpc.refuse(request, "StreamEnqueue", self._context)
                access.require_key()
                await self._take(request)
                del request  # only its answer is kept while owed
            self._owed.end()
            await self._finish_parts()
            await writer
            if stopping:
                raise Unavailable("broker is shutting down")
        finally:
            for task in self._tasks(writer):
                task.cancel()
            for task in self._tasks(writer):
                with contextlib.suppress(asyncio.CancelledError, BrokerError, grpc.RpcError):
                    await task
            for remote in self._remotes.values():
                remote.call.cancel()

    def _tasks(self, writer: asyncio.Task[None]) -> list[asyncio.Task[None]]:
        tasks = [writer, *(r.reader for r in self._remotes.values() if r.reader is not None)]
        if self._local_task is not None:
            tasks.append(self._local_task)
        return [t for t in tasks if not t.done()]

    # -- one request -------------------------------------------------------------------

    async def _take(self, request: service_pb2.StreamEnqueueRequest) -> None:
        messages = request.messages
        pending = _Pending(request.sequence_number, len(messages), self._owed)
        if len(messages) > self._max_batch:
            error = InvalidArgument(
                f"a batch may carry at most {self._max_batch} messages "
                f"(server.max_batch_messages), got {len(messages)}"
            )
            pending.complete(stream_answer(pending.sequence, [error] * len(messages)))
            return
        groups: dict[Target, list[int]] = {}
        failed: dict[int, BrokerError] = {}
        targets: dict[str, Target | BrokerError] = {}
        for index, message in enumerate(messages):
            target = targets.get(message.queue)
            if target is None:
                target = await self._target(message.queue)
                targets[message.queue] = target
            if isinstance(target, BrokerError):
                failed[index] = target
            else:
                groups.setdefault(target, []).append(index)
        pending.missing = len(groups) + (1 if failed else 0)
        if pending.missing == 0:
            pending.complete(stream_answer(pending.sequence, []))
            return
        if failed:
            indexes = sorted(failed)
            pending.fail(indexes, failed.__getitem__)
        elif len(groups) == 1 and LOCAL in groups:  # all here: the single-node path
            self._send_local(pending, groups[LOCAL], request, whole=True)
            return
        for target, indexes in groups.items():
            part = service_pb2.StreamEnqueueRequest(messages=[messages[i] for i in indexes])
            if target is LOCAL:
                self._send_local(pending, indexes, part, whole=False)
            else:
                assert isinstance(target, NodeRecord)
                await self._send_remote(target, pending, indexes, part)

    async def _target(self, queue: str) -> Target | BrokerError:
        """Where `queue`'s items go, or the error they get: PERMISSION_DENIED first
        (the owner would refuse them too, and looking up a queue the caller may not
        touch would let any key make this node read etcd at will)."""
        if not access.permits(Kind.PRODUCE, queue):
            return access.denied(Kind.PRODUCE, queue)
        try:
            return await self._router.target(queue, forwarded=self._forwarded)
        except BrokerError as exc:
            return exc

    # -- the local part ------------------------------------------------------------------

    def _send_local(
        self,
        pending: _Pending,
        indexes: list[int],
        part: service_pb2.StreamEnqueueRequest,
        *,
        whole: bool,
    ) -> None:
        if self._local_task is None:
            context = _CaptureContext(self._context, self._local_answer)
            self._local_task = asyncio.create_task(
                self._run_local(_drain(self._local_in), cast(Context, context))
            )
        self._local_parts.append((pending, indexes, whole))
        self._local_in.put_nowait(part)

    async def _run_local(self, requests: AsyncIterator[Any], context: Context) -> None:
        await self._inner(requests, context)

    def _local_answer(self, response: bytes) -> None:
        """The local handler's encoded answer to the next local part."""
        pending, indexes, whole = self._local_parts.popleft()
        if whole:  # the request's answer, as encoded (the producer's sequence number)
            pending.missing = 0
            pending.complete(response)
            return
        results = service_pb2.StreamEnqueueResponse.FromString(response).results
        pending.fill(indexes, [result.SerializeToString() for result in results])

    # -- the remote parts ----------------------------------------------------------------

    async def _send_remote(
        self,
        node: NodeRecord,
        pending: _Pending,
        indexes: list[int],
        part: service_pb2.StreamEnqueueRequest,
    ) -> None:
        remote = self._remotes.get(node.node_id)
        if remote is None or remote.broken is not None or remote.node != node:
            link, call = self._peers.stream(node, METHOD, self._peers.metadata(self._context))
            remote = self._remotes[node.node_id] = _Remote(node, link, call)
            remote.reader = asyncio.create_task(self._read_remote(remote))
        remote.sequence += 1
        part.sequence_number = remote.sequence
        queues = [m.queue for m in part.messages]
        remote.parts[remote.sequence] = (pending, indexes, queues)
        if remote.link.cut:  # a record read before the node left or came back: no write
            self._break(remote, OwnerDown("-", node.node_id))
            return
        try:
            await self._write(remote, part.SerializeToString())
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            self._break(remote, _transport_error(exc, remote))
        except asyncio.CancelledError:
            if not cut_off(remote.link):
                raise
            self._break(remote, OwnerDown("-", node.node_id))

    async def _write(self, remote: _Remote, raw: bytes) -> None:
        """Writes one part, or gives up once the stream's reader has ended: a write on a
        call its closed channel ended never returns (seen: the link cut while the write
        waited), and this stream's every later request waited behind it."""
        write = asyncio.ensure_future(remote.call.write(raw))
        reader = remote.reader
        if reader is not None:
            try:
                await asyncio.wait((write, reader), return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                write.cancel()
                raise
            if not write.done():  # the stream is over: this write never will be
                write.cancel()
                self._break(remote, remote.broken or OwnerDown("-", remote.node.node_id))
                return
        await write

    async def _read_remote(self, remote: _Remote) -> None:
        try:
            async for raw in remote.call:
                response = service_pb2.StreamEnqueueResponse.FromString(raw)
                found = remote.parts.pop(response.sequence_number, None)
                if found is not None:
                    pending, indexes, _queues = found
                    pending.fill(indexes, [r.SerializeToString() for r in response.results])
        except grpc.aio.AioRpcError as exc:
            self._break(remote, _transport_error(exc, remote))
            return
        except asyncio.CancelledError:
            if not cut_off(remote.link):
                raise
            self._break(remote, OwnerDown("-", remote.node.node_id))
            return
        if remote.parts:  # the owner ended its stream without answering everything
            self._break(remote, OwnerDown("-", remote.node.node_id))

    def _break(self, remote: _Remote, error: BrokerError) -> None:
        if remote.broken is None:
            remote.broken = error
        parts, remote.parts = remote.parts, {}
        node_id = remote.node.node_id
        for pending, indexes, queues in parts.values():
            errors = [
                OwnerDown(q, node_id) if isinstance(error, OwnerDown) else error for q in queues
            ]
            pending.fill(indexes, [error_result(e) for e in errors])

    # -- answers -------------------------------------------------------------------------

    async def _write_answers(self) -> None:
        owed = self._owed
        try:
            while (pending := await owed.get()) is not None:
                await pending.done
                await self._context.write(pending.answer)
                owed.written(pending.counted)
        finally:
            owed.writer_ended()

    async def _finish_parts(self) -> None:
        """The producer closed its side: close ours, so every part gets its answer."""
        self._local_in.put_nowait(None)
        for remote in self._remotes.values():
            if remote.broken is None and not remote.link.cut:
                try:
                    await remote.call.done_writing()
                except (grpc.RpcError, asyncio.InvalidStateError):
                    pass  # its reader reports what happened
                except asyncio.CancelledError:
                    if not cut_off(remote.link):
                        raise
        if self._local_task is not None:
            await self._local_task
        readers = [r.reader for r in self._remotes.values() if r.reader is not None]
        if readers:
            await asyncio.gather(*readers)


async def _drain(
    source: asyncio.Queue[service_pb2.StreamEnqueueRequest | None],
) -> AsyncIterator[service_pb2.StreamEnqueueRequest]:
    while (request := await source.get()) is not None:
        yield request


def _transport_error(exc: BaseException, remote: _Remote) -> BrokerError:
    if isinstance(exc, grpc.aio.AioRpcError):
        return translate(exc, lambda: OwnerDown("-", remote.node.node_id))
    return OwnerDown("-", remote.node.node_id)
