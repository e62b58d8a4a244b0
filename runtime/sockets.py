"""One socket factory: every socket gets LINGER, high-water marks, a message size limit and, for
ROUTER, MANDATORY.

Sockets are not thread-safe: each is made and used by one thread.
"""
from __future__ import annotations

import time

import zmq

from deltafin.protocol import messages as M


def make_socket(ctx: zmq.Context, kind: int, identity: str | None = None, hwm: int = 10000,
                max_bytes: int = M.MAX_MESSAGE_BYTES) -> zmq.Socket:
    """max_bytes: the largest inbound frame; a peer that sends a larger one is disconnected by
    ZeroMQ before the frame is buffered (it never reaches our memory or our decoder)."""
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)  # shutdown never blocks on undelivered messages
    s.setsockopt(zmq.SNDHWM, hwm)
    s.setsockopt(zmq.RCVHWM, hwm)
    s.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    if kind == zmq.ROUTER:
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer -> error, not a silent drop
    if identity:
        s.setsockopt(zmq.IDENTITY, identity.encode())
    return s


def send(sock: zmq.Socket, msg, to: bytes | None = None) -> None:
    if to is None:
        sock.send(M.encode(msg))
    else:
        sock.send_multipart([to, M.encode(msg)])


def recv(sock: zmq.Socket, routed: bool = False):
    """(sender, message) for ROUTER sockets, else message. Raises ProtocolError for bad bytes."""
    if routed:
        frames = sock.recv_multipart()
        if len(frames) != 2:
            raise M.ProtocolError(f"expected [identity, message], got {len(frames)} frames")
        return frames[0], M.decode(frames[1])
    return M.decode(sock.recv())


def wait_readable(sock: zmq.Socket, timeout_s: float, alive=None, what: str = "a reply",
                  spin_s: float = 0.0) -> None:
    """Polls in short steps so a dead peer (alive() false) or the deadline ends the wait; the
    first spin_s without sleeping (bench.spin_ms)."""
    if spin_s > 0:
        end = time.perf_counter() + min(spin_s, timeout_s)
        while time.perf_counter() < end:
            if sock.poll(0):
                return
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        if sock.poll(min(200, max(1, int(left * 1000)))):
            return
        if alive is not None and not alive():
            raise ConnectionError(f"peer died while waiting for {what}")
