"""How well a MoE layer's input foresees a later layer's experts through that layer's gate: the
gate lookahead (`SparseMoE` in runtime/models/decoder.py) uses the next layer's gate on this
layer's input; would layers further ahead give reads more time to land?

  python docs/probes/lookahead_recall.py HF_DIR [TOKENS]

HF_DIR: a qwen3_moe checkpoint mlx-lm loads (e.g. `deltafin-synth tiny qwen3_moe ... --init hf`).
Greedy decode through mlx-lm in float32 (MLX CPU's GatherMM takes no bfloat16); for each decode
token and MoE layer i, the top-k of layer i+d's gate on layer i's MoE input against layer i+d's
own top-k: mean recall per d = 1..4; and for d = 1, the recall of the m best guesses (m = 1.5k,
2k), what a wider lease would read.
"""
from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen3_moe

PROMPT = [1, 504, 3458, 314, 260, 6123, 4876, 47, 198]


def top(gate, x, k: int) -> set:
    scores = np.array(gate(x[:, -1:]).astype(mx.float32)).reshape(-1)
    return set(np.argsort(-scores)[:k].tolist())


def main() -> None:
    path, tokens = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 64
    model, _ = load(path)
    model.set_dtype(mx.float32)
    k = model.args.num_experts_per_tok
    seen = []  # (block, its input) per MoE layer of the current token
    plain = qwen3_moe.Qwen3MoeSparseMoeBlock.__call__

    def recording(self, x):
        seen.append((self, x))
        return plain(self, x)

    qwen3_moe.Qwen3MoeSparseMoeBlock.__call__ = recording
    recall = {d: [] for d in (1, 2, 3, 4)}
    wider = {m: [] for m in (k + k // 2, 2 * k)}
    for t, _ in zip(range(tokens), generate_step(mx.array(PROMPT), model, max_tokens=tokens)):
        if t > 0:  # the prompt's pass is not a decode token
            own = [top(b.gate, x, k) for b, x in seen]
            for i, (_, x) in enumerate(seen):
                for d in recall:
                    if i + d < len(seen):
                        recall[d].append(len(top(seen[i + d][0].gate, x, k) & own[i + d]) / k)
                if i + 1 < len(seen):
                    for m in wider:
                        wider[m].append(len(top(seen[i + 1][0].gate, x, m) & own[i + 1]) / k)
        seen.clear()
    for d, v in recall.items():
        print(f"{d} layer(s) ahead: top-{k} recall {np.mean(v):.3f} over {len(v)} (token, layer) pairs")
    for m, v in wider.items():
        print(f"1 layer ahead, {m} guesses: top-{k} recall {np.mean(v):.3f}")


if __name__ == "__main__":
    main()
