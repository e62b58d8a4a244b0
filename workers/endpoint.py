"""The supervisor's client-facing ROUTER socket (`ClientEndpoint`)."""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import zmq
from deltafin.protocol import messages as M
from deltafin.runtime.security import CurveServer, file_identity, ipc_path, remove_socket_file
from deltafin.runtime.sockets import make_socket
from deltafin.workers.workerset import SupervisorError

class ClientEndpoint:
    """The client-facing ROUTER socket. A request is one frame; a DEALER sends it alone, a REQ
    after an empty delimiter frame, and each gets its replies in the same envelope (a REQ peer
    takes exactly one reply per request, so it gets no `token` messages). Frames over
    runtime.max_request_bytes are refused by ZeroMQ itself (the peer is disconnected)."""

    REQ_PEERS_KEPT = 4096

    def __init__(self, ctx: zmq.Context, endpoint: str, max_bytes: int, curve: CurveServer | None):
        self.sock = make_socket(ctx, zmq.ROUTER, max_bytes=max_bytes)
        self.max_bytes = max_bytes
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
        if endpoint.startswith("ipc://"):
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
        frames = [ident, b"", M.encode(msg)] if req else [ident, M.encode(msg)]
        try:
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def close(self) -> None:
        self.sock.close(0)
        if self.socket_file is not None:  # ZeroMQ leaves the ipc socket file behind
            remove_socket_file(self.socket_file, self._identity)

