"""Held-out perplexity of the demo's trained weights (SmolLM2-135M-Instruct, shipped as GGUF Q4_1,
dequantized to float32: the only trained float weights at hand) against the same float weights
quantized again by MLX's affine quantize at several bits / group sizes, every linear layer of the
30 blocks; numpy float32 forward (tools/moefy.py's Dense, its held-out stdlib docstrings).
Quantizing these float values is not the exact Q4_1 -> MLX conversion the demo store makes (the
GGUF's own nibbles, scales and biases): it picks its own scales, so even 4-bit group 32 moves
the weights, as quantizing a float model does.
python docs/probes/requant_ppl.py [SEQS]   (docs: 8)"""
import sys
import time

import mlx.core as mx
import numpy as np

from deltafin.tools.moefy import SEQ, _setup, evaluate, stdlib_docstrings, token_sequences

N = int(sys.argv[1]) if len(sys.argv) > 1 else 8
SETTINGS = [(8, 64), (4, 32), (4, 64), (3, 64)]  # 576-wide inputs: no group 128
dense, tok = _setup()
seqs = token_sequences(tok, stdlib_docstrings(True, N * SEQ * 6), N)
t0 = time.time()
base = float(np.exp(evaluate(dense, seqs, None)[0].mean()))
print(f"the Q4_1 weights dequantized (float32): ppl {base:.3f} on {seqs.size} held-out tokens "
      f"({time.time() - t0:.0f} s)", flush=True)
original = dict(dense.w)
linear = [k for k in original if k.startswith("model.layers.") and k.endswith("_proj.weight")]
for bits, group in SETTINGS:
    for k in linear:
        w = mx.array(original[k])
        q = mx.quantize(w, group_size=group, bits=bits)
        dense.w[k] = np.array(mx.dequantize(*q, group_size=group, bits=bits), dtype=np.float32)
    ppl = float(np.exp(evaluate(dense, seqs, None)[0].mean()))
    print(f"quantized again, affine {bits}-bit group {group:3d}: ppl {ppl:.3f} ({100 * (ppl / base - 1):+.2f}%)", flush=True)
dense.w.update(original)
