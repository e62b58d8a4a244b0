"""Qwen3.5 / Qwen3.6 MoE: Qwen3-Next's layers (gated_delta.py) with separate q/k/v, z, b and a
projections in the linear layers, a routed MoE on every layer, renormalised top-k by default, and
rope from rope_parameters. The converter stores the language model of the multimodal checkpoint
(archinfo.text_model)."""

from .qwen3_next import Qwen3Next

# mlx-lm's rope_parameters when a config has none
ROPE_DEFAULTS = {"type": "default", "rope_theta": 100000.0, "partial_rotary_factor": 0.25}


class Qwen3_5Moe(Qwen3Next):
    norm_topk_default = True

    def rope_parameters(self, c):
        """(theta, rotary fraction of head_dim, scaling) as mlx-lm's Qwen3.5 reads them: from
        rope_parameters (mlx-lm's defaults where the key is absent); where it is null or empty,
        from the top-level rope_theta, partial_rotary_factor and rope_scaling."""
        params = c["rope_parameters"] if "rope_parameters" in c else ROPE_DEFAULTS
        if not params:
            return (float(c.get("rope_theta", ROPE_DEFAULTS["rope_theta"])),
                    float(c.get("partial_rotary_factor", ROPE_DEFAULTS["partial_rotary_factor"])),
                    c.get("rope_scaling"))
        return (float(params.get("rope_theta", ROPE_DEFAULTS["rope_theta"])),
                float(params.get("partial_rotary_factor", ROPE_DEFAULTS["partial_rotary_factor"])), dict(params))
