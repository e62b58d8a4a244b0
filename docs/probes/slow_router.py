"""A more cache-friendly MoEfied demo, at a quality cost: routers restricted to the slowest-varying
directions of each layer's FFN input (slow feature analysis on the calibration text).

  SLOW=M OPENBLAS_NUM_THREADS=1 python docs/probes/slow_router.py [moefy options] --out F.npz
  python -m deltafin.tools.moefy --evaluate F.npz

tools/moefy.py's router (ridge regression, then cross-entropy towards the oracle top-k) is
trained here on z = h B instead of h, where B [H, M] holds the M directions along which h changes
least from one token to the next relative to its variance (the smallest generalized eigenvalues
of Cov(h_t - h_{t-1}) against Cov(h), consecutive tokens of a sequence only); the gate written is
A B^T, still a plain [E, H] Qwen2-MoE gate, so the store and the runtime do not change. Smaller M:
routing that changes less from token to token (more reuse, more cache hits) and a worse router.
Figures: docs/DEMO-MOE.md, "A router for locality (explored, not shipped)".
"""
import os
import sys

import numpy as np

from deltafin.tools import moefy

M = int(os.environ.get("SLOW", "128"))
_train = moefy.train_router


def slow_router(x, target, top_k, steps=100, lr=2e-2):
    keep = (np.arange(len(x)) % moefy.SEQ) != 0  # x is [sequences x SEQ, H], in order
    d = (x[1:] - x[:-1])[keep[1:]]
    xc = x - x.mean(0)
    cov = xc.T.astype(np.float64) @ xc / len(x) + 1e-6 * np.eye(x.shape[1])
    w, u = np.linalg.eigh(cov)
    white = u / np.sqrt(w)
    _, v = np.linalg.eigh(white.T @ (d.T.astype(np.float64) @ d / len(d)) @ white)
    b = (white @ v[:, :M]).astype(np.float32)  # the M slowest directions
    return (_train(x @ b, target, top_k, steps, lr) @ b.T).astype(np.float32)


if __name__ == "__main__":
    moefy.train_router = slow_router
    sys.exit(moefy.main(sys.argv[1:]))
