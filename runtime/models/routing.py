"""Routing functions: gate logits [..., E] -> (inds [..., k], weights [..., k]), one per scheme.

A family picks its scheme in its file (`MoETransformer.router`, usually a functools.partial of
one of these with the config's numbers); shared code only calls what it was given. Each keeps
mlx-lm's op order for its family (which selection form, where the cast), so the chosen experts'
weights are summed in the same order and logits match mlx-lm bitwise.
"""
import mlx.core as mx


def softmax_topk(logits, k, norm=False):
    """Softmax over all experts, keep the k best (optionally renormalised) (OLMoE, Qwen2-MoE)."""
    probs = mx.softmax(logits, axis=-1, precise=True)
    inds = mx.argpartition(-probs, kth=k - 1, axis=-1)[..., :k]
    scores = mx.take_along_axis(probs, inds, axis=-1)
    return inds, (scores / scores.sum(axis=-1, keepdims=True) if norm else scores)


def softmax_topk_tail(logits, k, norm=False):
    """softmax_topk in mlx-lm's Qwen3-MoE selection form (the k largest taken from the tail of the
    partition), which fixes the order in which the k experts are summed."""
    probs = mx.softmax(logits, axis=-1, precise=True)
    inds = mx.argpartition(probs, kth=-k, axis=-1)[..., -k:]
    scores = mx.take_along_axis(probs, inds, axis=-1)
    if norm:
        scores = scores / mx.sum(scores, axis=-1, keepdims=True)
    return inds, scores


def topk_softmax(logits, k):
    """The k largest logits, weighted by a softmax over those k only (Mixtral)."""
    inds = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
    return inds, mx.softmax(mx.take_along_axis(logits, inds, axis=-1), axis=-1, precise=True)


def softmax_group_limited(logits, k, n_group=1, topk_group=1, scale=1.0, group_limited=False):
    """Softmax over all experts; with group_limited, every expert outside the topk_group groups
    holding the best single experts is zeroed first; the k best, times scale (DeepSeek-V2)."""
    probs = mx.softmax(logits, axis=-1, precise=True)
    drop = n_group - topk_group
    if group_limited and drop > 0:
        grouped = mx.unflatten(probs, -1, (n_group, -1))
        best = grouped.max(axis=-1, keepdims=True)
        dropped = mx.argpartition(best, kth=drop - 1, axis=-2)[..., :drop, :]
        probs = mx.put_along_axis(grouped, dropped, mx.array(0.0, probs.dtype), axis=-2)
        probs = probs.reshape(logits.shape)
    inds = mx.argpartition(-probs, kth=k - 1, axis=-1)[..., :k]
    return inds, mx.take_along_axis(probs, inds, axis=-1) * scale


@mx.compile
def _sigmoid_grouped(logits, bias, k, n_group, topk_group, scale, norm):
    # Compiled like mlx-lm's group_expert_select so the float32 math fuses the same way.
    probs = mx.sigmoid(logits.astype(mx.float32))
    pick = probs + bias
    if n_group > 1 and topk_group < n_group:
        pick = mx.unflatten(pick, -1, (n_group, -1))
        group_score = mx.topk(pick, 2, axis=-1).sum(axis=-1, keepdims=True)
        drop = n_group - topk_group
        dropped = mx.argpartition(group_score, kth=drop - 1, axis=-2)[..., :drop, :]
        pick = mx.flatten(mx.put_along_axis(pick, dropped, mx.array(0.0), axis=-2), -2, -1)
    inds = mx.argpartition(-pick, kth=k - 1, axis=-1)[..., :k]
    weights = mx.take_along_axis(probs, inds, axis=-1)
    if k > 1 and norm:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return inds, weights * scale


def sigmoid_grouped_topk(logits, bias, k, n_group=1, topk_group=1, scale=1.0, norm=True):
    """Sigmoid scores; the selection adds the correction bias and keeps only the topk_group best
    groups (a group scores the sum of its two best experts); weights are the raw sigmoids,
    optionally renormalised, times scale (DeepSeek-V3, Kimi-K2)."""
    return _sigmoid_grouped(logits, bias, k, n_group, topk_group, scale, norm)


def topk_tail_softmax(logits, k):
    """The k largest logits taken from the tail of the partition, weighted by a softmax over those
    k only (gpt-oss's selection form, which fixes the order the k experts are summed in)."""
    inds = mx.argpartition(logits, kth=-k, axis=-1)[..., -k:]
    return inds, mx.softmax(mx.take_along_axis(logits, inds, axis=-1), axis=-1, precise=True)


def sigmoid_bias_topk(logits, bias, k, dtype):
    """Sigmoid scores (of float32 logits); the selection adds the correction bias; weights are the
    chosen sigmoids over their sum (+1e-20), cast to the model's dtype (MiniMax-M2)."""
    probs = mx.sigmoid(logits)
    inds = mx.argpartition(-(probs + bias), kth=k - 1, axis=-1)[..., :k]
    weights = mx.take_along_axis(probs, inds, axis=-1)
    return inds, (weights / (mx.sum(weights, axis=-1, keepdims=True) + 1e-20)).astype(dtype)


@mx.compile
def _kimi_grouped(logits, bias, k, n_group, topk_group, scale, norm, score, in_float32):
    # Compiled like mlx-lm's kimi group_expert_select (its op order, its 1e-20), so it rounds the same.
    in_type = logits.dtype
    if score == "softmax":
        probs = mx.softmax(logits, axis=-1, precise=True)
    else:
        probs = mx.sigmoid(logits.astype(mx.float32) if in_float32 else logits)
    pick = probs + bias.astype(probs.dtype)
    if n_group > 1:
        pick = mx.unflatten(pick, axis=-1, shape=(n_group, -1))
        group_score = mx.topk(pick, 2, axis=-1).sum(axis=-1, keepdims=True)
        drop = n_group - topk_group
        dropped = mx.argpartition(group_score, kth=drop - 1, axis=-2)[..., :drop, :]
        pick = mx.put_along_axis(pick, mx.stop_gradient(dropped), mx.array(0.0, dtype=pick.dtype), axis=-2)
        pick = mx.flatten(pick, -2, -1)
    inds = mx.stop_gradient(mx.argpartition(-pick, kth=k - 1, axis=-1)[..., :k])
    weights = mx.take_along_axis(probs, inds, axis=-1)
    if k > 1 and norm:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    weights = weights * scale
    return inds, (weights.astype(in_type) if in_float32 else weights)


def kimi_grouped_topk(logits, bias, k, n_group=1, topk_group=1, scale=1.0, norm=True, score="sigmoid",
                      in_float32=False):
    """Kimi's scheme (kimi_linear, kimi_k3): sigmoid (or softmax) scores, the selection adds the
    correction bias and keeps the topk_group best groups (a group scores its two best experts);
    weights are the raw scores renormalised (over their sum + 1e-20) and times scale. in_float32
    (Kimi K3): the scores are taken in float32 and the weights cast back to the logits' dtype."""
    return _kimi_grouped(logits, bias, k, n_group, topk_group, scale, norm, score, in_float32)
