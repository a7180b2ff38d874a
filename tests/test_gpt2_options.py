"""The gpt2 recipe's model options: bias, gelu and scaled_proj_init (nanoGPT's model is
bias=false gelu=erf scaled_proj_init=true). Their forward and gradients against PyTorch:
tests/test_parity.py (gpt2-nanogpt); the erf kernels: tests/test_cpu_kernels.py."""

import numpy as np
from toyharness_recipes.gpt2 import GPT2Options, recipe

# nanoGPT's shakespeare-char model (config/train_shakespeare_char.py, bias=False): its 65-character
# vocabulary; 10,745,088 parameters with the position table (it prints 10.65M, leaving that out)
BABY = dict(n_layer=6, n_head=6, d_model=384, t_seq=256)


def count(params) -> int:
    return sum(v.size for v in params.values())


def test_bias_false_has_nanogpts_parameter_count_and_no_bias():
    params = recipe.init_params(GPT2Options(**BABY, bias=False), 65)
    assert count(params) == 10_745_088
    assert not [n for n in params if n.endswith(".bias")]
    with_biases = recipe.init_params(GPT2Options(**BABY), 65)
    # per block: q, k, v, o and ffn_down biases (d each), ffn_up's (4d), two LayerNorms' (d each); the final norm's
    assert count(with_biases) - count(params) == 6 * (5 * 384 + 4 * 384 + 2 * 384) + 384


def test_scaled_proj_init_draws_the_residual_projections_at_002_over_sqrt_2_n_layer():
    small = dict(n_layer=3, d_model=32, n_head=2, t_seq=16)
    plain = recipe.init_params(GPT2Options(**small), 50)
    scaled = recipe.init_params(GPT2Options(**small, scaled_proj_init=True), 50)
    assert sorted(plain) == sorted(scaled)
    for name, value in plain.items():
        if name.endswith(("attn_output.weight", "ffn_down.weight")):
            # the same draws, scaled: std 0.02 / sqrt(6)
            np.testing.assert_allclose(scaled[name], value / np.sqrt(6), rtol=1e-6, err_msg=name)
            assert abs(scaled[name].std() / (0.02 / np.sqrt(6)) - 1) < 0.1
        else:
            np.testing.assert_array_equal(scaled[name], value, err_msg=name)
