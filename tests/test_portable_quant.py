"""Frozen weights of every type in the portable golden mode (native/portable_quant.c and the
frozen kernels of native/portable_kernels.c).

The portable mode reads a frozen weight through our own dequantization, compiled with
-ffp-contract=off: it must be gguf-py's numpy dequantizer bit for bit, for every type, so that
its products are those of the f32 model of the dequantized weights on every CPU. The products
must then give exactly the bits of the portable f32 product over those weights, at any thread
count, and never widen the weight whole into the graph.
"""

import numpy as np
import pytest

from toyharness._ffi import ffi, lib
from toyharness.engine import GGUFFile, get_engine
from toyharness.engine.gguf_io import copy_gguf_as
from toyharness.engine.quant import FROZEN, FROZEN_NAMES, dequantize, quantize
from toyharness.lm import seeded_model_file

NOT_F32 = [n for n in FROZEN_NAMES if n != "f32"]
# the bytes of each quantized type's block that hold f16 scales (ggml-common.h's layouts)
F16_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q5_0": (0,), "q4_1": (0, 2), "q5_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2),
              "q6_k": (208,)}
BASE_256 = ["n_layer=1", "d_model=256", "n_head=4", "n_kv_head=2", "d_ff=512", "seed=3"]


def dequantize_ours(raw: np.ndarray, name: str, n: int, out: np.ndarray | None = None) -> int:
    out = np.empty(n, np.float32) if out is None else out
    return lib.th_portable_dequantize(FROZEN[name].ggml_type, ffi.from_buffer(raw), ffi.from_buffer("float[]", out), n)


def ours(raw: np.ndarray, name: str, n: int) -> np.ndarray:
    out = np.empty(n, np.float32)
    assert dequantize_ours(raw, name, n, out) == 0, f"{name}: th_portable_dequantize refused {n} values"
    return out


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("name", [n for n in NOT_F32 if n not in ("f16", "bf16")])
def test_dequantization_is_gguf_pys_bit_for_bit(name):
    """Weights quantized by ggml (values over 12 decades, zeros, a constant block), then random
    blocks: every quant code, scales normal, subnormal and zero."""
    q, rng = FROZEN[name], np.random.default_rng(11)
    rows, n = 64, 512
    values = rng.standard_normal((rows, n)).astype(np.float32) * (10.0 ** rng.uniform(-9, 3, (rows, 1)))
    values[3] = 0.0
    values[5, : q.block] = 0.25
    raw = quantize(values.astype(np.float32), name)
    ref = dequantize(raw, q.ggml_type, (rows, n))
    assert same_bits(ours(raw, name, rows * n), ref.reshape(-1)), name

    blocks = rng.integers(0, 256, (4096, q.block_bytes), dtype=np.uint8)
    scales = (rng.standard_normal(4096 * 2) * 10.0 ** rng.uniform(-9, 2, 4096 * 2)).astype(np.float16)
    scales[::17] = 0.0
    for k, offset in enumerate(F16_FIELDS[name]):
        blocks[:, offset:offset + 2] = scales[k::2][:4096, None].view(np.uint8).reshape(4096, 2)
    n_random = 4096 * q.block
    ref = dequantize(blocks.reshape(-1), q.ggml_type, (n_random,))
    assert same_bits(ours(blocks, name, n_random), ref), name


@pytest.mark.parametrize("name", ["f16", "bf16"])
def test_every_half_and_bfloat_pattern_widens_as_gguf_py_does(name):
    bits = np.arange(1 << 16, dtype=np.uint16)
    ref = dequantize(bits.view(np.uint8), FROZEN[name].ggml_type, (1 << 16,))
    got = ours(bits, name, 1 << 16)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan)
    assert same_bits(got[~nan], ref[~nan])      # NaN payloads aside (numpy may quiet them)


def test_types_and_lengths_it_does_not_read_are_refused():
    raw = np.zeros(256, np.uint8)
    assert dequantize_ours(raw, "f32", 16) == -1
    assert dequantize_ours(raw, "q8_0", 33) == -1 and dequantize_ours(raw, "q8_0", 32) == 0


# --- the products ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    folder = tmp_path_factory.mktemp("portable-quant")
    base = seeded_model_file("llama", BASE_256)
    return {name: copy_gguf_as(base, folder / f"base-{name}.gguf", name) for name in NOT_F32}


def portable_products(threads: int, weight, x: np.ndarray, r: np.ndarray, ids: np.ndarray):
    """In the portable mode: y = x W^T, dL/dx for L = sum(r * y), and W's rows at `ids`; W a
    tensor of an open GGUF (kept in its type) or an f32 array; and the graph's ggml op names."""
    engine = get_engine("cpu", threads)
    engine.set_portable(True)
    try:
        prog = engine.program()
        w = prog.frozen_gguf(*weight) if isinstance(weight, tuple) else prog.frozen_array("w", weight)
        xp = prog.param("x", x)
        y = xp.matmul_t(w)
        trainer = prog.trainer(prog.scalar_loss((y * prog.constant("r", r)).sum()), "bias_corrected")
        ops = {ffi.string(lib.ggml_op_desc(lib.ggml_graph_node(trainer.gb_grad, i))).decode()   # as built
               for i in range(lib.ggml_graph_n_nodes(trainer.gb_grad))}
        trainer.grads_only({})
        # read before another graph runs: a gradient is a node of the backward graph, in the
        # compute buffer the next graph reuses (the Trainer keeps gradients as graph outputs)
        dx = prog.read(trainer.grad_acc["x"])
        rows = w.get_rows(prog.constant("ids", ids))
        fwd = prog.forward({"y": y, "rows": rows}).run({})
        return fwd["y"], dx, fwd["rows"], ops
    finally:
        engine.set_portable(False)


@pytest.mark.parametrize("dtype", NOT_F32)
def test_frozen_products_are_the_f32_products_of_the_dequantized_weight_bit_for_bit(bases, dtype):
    """Forward, input gradient and embedding rows of a weight kept in its type: exactly the bits
    of the same portable program over gguf-py's dequantized f32 weight, at 1 and 3 threads,
    with no GET_ROWS widening the weight into the graph."""
    rng = np.random.default_rng(5)
    for name in ("blk.0.ffn_down.weight", "blk.0.attn_k.weight", "token_embd.weight"):
        with GGUFFile(bases[dtype]) as f:
            info = f.tensor(name)
            w = dequantize(info.raw_bytes(), info.ggml_type, info.shape)
        x = rng.standard_normal((37, w.shape[1])).astype(np.float32)
        r = rng.standard_normal((37, w.shape[0])).astype(np.float32)
        ids = rng.integers(0, w.shape[0], 9).astype(np.int32)
        ref = portable_products(2, w, x, r, ids)
        with GGUFFile(bases[dtype]) as f:
            for threads in (1, 3):
                y, dx, rows, ops = portable_products(threads, (f, name), x, r, ids)
                assert same_bits(y, ref[0]) and same_bits(dx, ref[1]), (dtype, name, threads)
                assert same_bits(rows, w[ids]), (dtype, name)
                assert "GET_ROWS" not in ops, ops
        assert np.max(np.abs(y - x.astype(np.float64) @ w.T.astype(np.float64))) < 1e-4 * np.max(np.abs(y))
