"""How long one ZeroMQ message takes from a ROUTER's send to a DEALER's receipt over ipc, as the
router's answers and read orders travel (runtime/sockets.py's `send`): N round trips of a 200-byte
frame, the mean per message. Usage: python docs/probes/zmq_hop.py [N]"""
import os
import sys
import tempfile
import time

import zmq


def main(n: int) -> None:
    ctx = zmq.Context()
    path = os.path.join(tempfile.mkdtemp(), "hop.sock")
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{path}")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"compute")
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"ipc://{path}")
    dealer.send(b"hello")
    if not router.poll(5000):
        raise SystemExit("no hello within 5 s")
    router.recv_multipart()
    payload = b"x" * 200
    t0 = time.perf_counter()
    for _ in range(n):
        router.send_multipart([b"compute", payload])
        if not dealer.poll(5000):
            raise SystemExit("a message was lost")
        dealer.recv()
    print(f"{(time.perf_counter() - t0) / n * 1e6:.1f} us per message ({n} messages)")
    router.close()
    dealer.close()
    ctx.term()
    os.unlink(path)
    os.rmdir(os.path.dirname(path))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20000)
