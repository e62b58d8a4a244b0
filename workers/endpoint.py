"""The supervisor's client-facing ROUTER socket (`ClientEndpoint`)."""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import zmq
from deltafin.protocol import messages as M
from deltafin.runtime.security import CurveServer, file_identity, ipc_path, is_abstract, remove_socket_file
from deltafin.runtime.sockets import make_socket
from deltafin.workers.workerset import SupervisorError

LARGE_REPLY_BYTES = 1 << 16  # replies from this size on are sent zero-copy and tracked until sent
UNSENT_PER_PEER = 2  # large replies one connection may have unsent; the next is dropped
CLOSE_LINGER_MS = 1000  # at close: how long replies already queued (`shutting_down`) may take


class ClientEndpoint:
    """The client-facing ROUTER socket. A request is one frame; a DEALER sends it alone, a REQ
    after an empty delimiter frame, and each gets its replies in the same envelope (a REQ peer
    takes exactly one reply per request, so it gets no `token` messages). Frames over
    runtime.max_request_bytes are refused by ZeroMQ itself (the peer is disconnected).

    Replies are bounded in bytes: ZeroMQ queues up to its high-water mark of messages per
    connection whatever their size, so each large reply (a logits result) is tracked until ZeroMQ
    has written it out. A connection may have UNSENT_PER_PEER of them unsent, and all connections
    together `reply_bytes`; a large reply beyond either (its client does not read) is replaced by
    a short `cancelled` error and counted in `dropped["unread"]`."""

    REQ_PEERS_KEPT = 4096

    def __init__(self, ctx: zmq.Context, endpoint: str, max_bytes: int, curve: CurveServer | None,
                 reply_bytes: int):
        self.sock = make_socket(ctx, zmq.ROUTER, max_bytes=max_bytes)
        self.max_bytes = max_bytes
        self.reply_bytes = reply_bytes
        self.unsent: dict[bytes, list[tuple[zmq.MessageTracker, int]]] = {}  # large replies in ZeroMQ
        self.dropped = {"unread": 0}
        self.req_peers: OrderedDict[bytes, None] = OrderedDict()
        self.socket_file: Path | None = None
        self._identity = None
        if curve is not None:
            curve.apply(self.sock)
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError as e:
            self.sock.close(0)
            raise SupervisorError(f"cannot bind {endpoint}: {e}") from None
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if endpoint.startswith("ipc://") and not is_abstract(endpoint):
            self.socket_file = ipc_path(endpoint)
            self._identity = file_identity(self.socket_file)

    def receive(self) -> tuple[bytes, bytes | None, str | None]:
        """(peer, request frame or None, why it cannot be read)."""
        frames = self.sock.recv_multipart()
        ident, body = frames[0], frames[1:]
        if len(body) > 1 and body[0] == b"":  # a REQ envelope (a lone empty frame is a message)
            self.req_peers[ident] = None
            self.req_peers.move_to_end(ident)
            while len(self.req_peers) > self.REQ_PEERS_KEPT:
                self.req_peers.popitem(last=False)
            body = body[1:]
        else:
            self.req_peers.pop(ident, None)
        if len(body) != 1:
            return ident, None, (f"a request is one frame (after an empty delimiter frame for REQ "
                                 f"sockets); got {len(body)}")
        return ident, body[0], None

    def reply(self, ident: bytes, msg) -> bool:
        """False when the peer is gone: ROUTER_MANDATORY makes a send to an identity whose
        connection closed fail at once (EHOSTUNREACH). A peer that has left the socket's high-water
        mark of replies unread (10,000) counts as gone too (EAGAIN): never sending blocking keeps
        one client from stalling the others."""
        req = ident in self.req_peers
        if req and isinstance(msg, M.Token):
            return True
        if isinstance(msg, M.Error) and len(msg.message) > M.MAX_ERROR_CHARS:  # never echo a request
            msg = M.Error(id=msg.id, code=msg.code, message=msg.message[:M.MAX_ERROR_CHARS] + "...")
        body = M.encode(msg)
        large = len(body) >= LARGE_REPLY_BYTES
        if large and not self._room(ident, len(body)):
            self.dropped["unread"] += 1
            body = M.encode(M.Error(id=getattr(msg, "id", None), code=M.ErrorCode.CANCELLED,
                                    message=f"a reply of {len(body)} bytes was dropped: this "
                                            f"connection leaves earlier replies unread"))
            large = False
        frames = [ident, b"", body] if req else [ident, body]
        try:
            if large:
                tracker = self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False, track=True)
                self.unsent.setdefault(ident, []).append((tracker, len(body)))
            else:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def _room(self, ident: bytes, size: int) -> bool:
        """Whether a large reply of `size` bytes may join those ZeroMQ has not written out yet."""
        for peer in list(self.unsent):
            left = [(t, n) for t, n in self.unsent[peer] if not t.done]
            if left:
                self.unsent[peer] = left
            else:
                del self.unsent[peer]
        total = sum(n for replies in self.unsent.values() for _, n in replies)
        return (len(self.unsent.get(ident, ())) < UNSENT_PER_PEER
                and (total == 0 or total + size <= self.reply_bytes))

    def close(self) -> None:
        """Replies already queued (the `shutting_down` errors of a stop) get CLOSE_LINGER_MS to
        go out; the context's termination waits for them that long at most."""
        self.sock.close(linger=CLOSE_LINGER_MS)
        if self.socket_file is not None:  # ZeroMQ leaves the ipc socket file behind
            remove_socket_file(self.socket_file, self._identity)

