"""Per-token log-probabilities for requests that ask for them (generate's `logprobs`): the
sampled token's and the k most likely tokens', from the step's logits in the model's dtype,
log-softmaxed the way the greedy sampler ranks them (workers/scheduler.sample_on_device), so a
greedy token's log-probability is the largest. Computed on the device with the step's tokens,
read back with them."""
from __future__ import annotations

import mlx.core as mx


def on_device(row, token, k: int, dtype=None) -> list:
    """Lazy arrays for one row [1, vocab] and its sampled token [1]: its log-probability and
    the k most likely tokens' ids and log-probabilities (unordered)."""
    x = row.astype(dtype or row.dtype)
    lp = (x - mx.logsumexp(x, axis=-1, keepdims=True)).reshape(-1)
    out = [lp[token.reshape(-1).astype(mx.uint32)]]
    if k:
        ids = mx.argpartition(-lp, kth=k - 1)[:k]
        out += [ids, lp[ids]]
    return out


def to_host(token: int, arrays: list) -> dict:
    """The token's entry of a `token` message's logprobs: {token_id, logprob, top: [[id, lp]]},
    top most likely first (ties: the lower id first)."""
    values = [a.astype(mx.float32).tolist() for a in arrays]
    top = sorted(zip(values[1], values[2]), key=lambda t: (-t[1], t[0])) if len(values) > 1 else []
    return {"token_id": token, "logprob": values[0][0], "top": [[int(i), v] for i, v in top]}
