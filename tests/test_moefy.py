"""moefy's shared blocks on a tiny random llama FFN (no GGUF): the MoE FFN against the dense FFN's
own neurons, and the loader's partition check with shared blocks."""
import numpy as np
import pytest

from deltafin.tools import moefy

H, BLOCKS = 8, 4


def _dense(rng):
    inter = BLOCKS * moefy.BLOCK
    w = {f"model.layers.0.mlp.{n}.weight": rng.standard_normal(shape).astype(np.float32)
         for n, shape in (("gate_proj", (inter, H)), ("up_proj", (inter, H)), ("down_proj", (H, inter)))}
    return moefy.Dense(w, {"num_hidden_layers": 1, "rms_norm_eps": 1e-5, "intermediate_size": inter})


def _moe(gates, top_k):
    return {"experts": np.array([[[1], [2], [3]]], np.int16), "shared": np.array([[0]], np.int16),
            "gates": gates[None].astype(np.float16), "top_k": np.int64(top_k), "block": np.int64(moefy.BLOCK)}


def test_shared_blocks_always_contribute_unscaled():
    """The shared blocks add their output with weight 1; routed experts weigh E x their softmax
    over all E (the Qwen2-MoE store's scaling), so with equal logits all experts give the dense FFN."""
    rng = np.random.default_rng(0)
    dense = _dense(rng)
    h = rng.standard_normal((5, H)).astype(np.float32)
    a = dense.neurons(0, h)
    ids = []
    full = moefy.moe_ffn(dense, 0, h, _moe(np.zeros((3, H)), 3), ids)  # all experts, weights 1/3 * 3
    np.testing.assert_allclose(full, dense.down(0, a), rtol=1e-5, atol=1e-5)
    gates = np.zeros((3, H))
    gates[1, 0] = 1.0  # expert 1 (block 2) wins where h[:, 0] > 0, expert 0 (block 1) otherwise
    one = moefy.moe_ffn(dense, 0, h, _moe(gates, 1), ids)
    chosen = np.where(h[:, 0] > 0, 2, 1)
    logits = h @ gates.T.astype(np.float32)
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    weight = 3 * p[np.arange(len(h)), chosen - 1]  # Qwen2-MoE: softmax over all 3, times E
    cols = np.arange(BLOCKS * moefy.BLOCK) // moefy.BLOCK
    scale = (cols[None] == 0) + (cols[None] == chosen[:, None]) * weight[:, None]
    np.testing.assert_allclose(one, dense.down(0, a * scale), rtol=1e-5, atol=1e-5)
    assert ids[1][:, 0].tolist() == (chosen - 1).tolist()


def test_loader_checks_shared_blocks_in_the_partition(tmp_path):
    path = tmp_path / "moe.npz"
    np.savez(path, **_moe(np.zeros((3, H)), 2))
    assert moefy.load_moe(path, 1, H, BLOCKS * moefy.BLOCK)["shared"].tolist() == [[0]]
    bad = _moe(np.zeros((3, H)), 2)
    bad["shared"] = np.array([[1]], np.int16)  # block 1 shared and routed, block 0 in neither
    np.savez(path, **bad)
    with pytest.raises(moefy.MoefyError, match="partition"):
        moefy.load_moe(path, 1, H, BLOCKS * moefy.BLOCK)
