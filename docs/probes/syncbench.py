"""Probe (H200): what a gate read-back per layer costs mlx-lm itself.

    python syncbench.py MLX_LM_CHECKPOINT

Prints the cost of a read-back after 1 and 10 chained ops, then mlx-lm's decode per token with one
sync per token against one read of the top-k ids before each layer's experts (what a design that
streams experts must do), twice.
"""
import time, sys, numpy as np, mlx.core as mx
from mlx_lm.utils import load
x = mx.array([1.0])
for n in (1, 10):
    ts = []
    for _ in range(300):
        y = x
        t0 = time.perf_counter()
        for _ in range(n): y = y + 1
        np.array(y); ts.append(time.perf_counter() - t0)
    print(f"chain of {n} adds + read-back: median {np.median(ts)*1e6:.0f} us", flush=True)
model, _ = load(sys.argv[1])
inner = model.model
from mlx_lm.models.cache import make_prompt_cache
def run(sync_every, steps=64):
    cache = make_prompt_cache(model)
    tok = mx.array([[1, 17, 42, 99, 3, 250, 7, 301, 64]])
    out = model(tok, cache=cache); mx.eval(out)
    t = mx.argmax(out[:, -1], axis=-1, keepdims=True); mx.eval(t)
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        h = inner.embed_tokens(t)
        from mlx_lm.models.base import create_attention_mask
        for layer, c in zip(inner.layers, cache):
            if sync_every:
                # the gate's top-k read back before the layer's experts, as a streaming layer does
                r = layer.self_attn(layer.input_layernorm(h), None, c)
                h2 = h + r
                xn = layer.post_attention_layernorm(h2)
                g = layer.mlp.gate(xn)
                inds = mx.argpartition(-g, kth=3, axis=-1)[..., :4]
                np.array(inds)
                h = h2 + layer.mlp(xn)
            else:
                h = layer(h, None, c)
        logits = model.lm_head(inner.norm(h)) if hasattr(model, "lm_head") else inner.embed_tokens.as_linear(inner.norm(h))
        t = mx.argmax(logits[:, -1], axis=-1, keepdims=True)
        np.array(t)
        ts.append(time.perf_counter() - t0)
    return np.median(ts) * 1e3
for rep in range(2):
    print(f"per token: one sync {run(False):.2f} ms, a gate read-back per layer {run(True):.2f} ms", flush=True)
