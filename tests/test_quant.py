"""Frozen bases of every supported type (engine/quant.py, native/frozen_matmul.c).

The bases are made by the harness (the llama recipe's seeded init) and quantized by ggml's own
quantizer; gguf-py's numpy dequantizer is the independent reading of the weights that the
engine's products are checked against.
"""

import subprocess
import sys

import numpy as np
import pytest
from helpers import needs

from toyharness._ffi import ffi, lib
from toyharness.engine import GGUFFile, get_engine
from toyharness.engine.gguf_io import copy_gguf_as, write_gguf
from toyharness.engine.quant import FROZEN, FROZEN_NAMES, dequantize, quantize
from toyharness.errors import GGUFError
from toyharness.lm import seeded_model_file
from toyharness.runner import train

QUANTIZED = [n for n in FROZEN_NAMES if n != "f32"]
# K-quants need rows of a multiple of 256 values: every matrix of this base has such rows.
BASE_256 = ["n_layer=1", "d_model=256", "n_head=4", "n_kv_head=2", "d_ff=512", "seed=3"]
STEPS = ["t_seq=16", "t_batch=4", "lr=1e-2", "warmup=1", "eval_every=1000", "checkpoint_every=1000"]


@pytest.fixture(scope="module")
def base_f32():
    return seeded_model_file("llama", BASE_256)


@pytest.fixture(scope="module")
def bases(base_f32, tmp_path_factory):
    """The base in every frozen type, by type name."""
    folder = tmp_path_factory.mktemp("quantized")
    return {name: copy_gguf_as(base_f32, folder / f"base-{name}.gguf", name) for name in FROZEN_NAMES}


def rel_err(got, ref):
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def frozen_product(path, name, threads, x, r, backend="cpu", cpu_kernels=True):
    """y = x W^T and dL/dx for L = sum(r * y), W the tensor `name` of `path` (bound in place on
    cpu, uploaded in its type elsewhere), and the names of our cpu kernels that ran."""
    prog = get_engine(backend, threads).program()
    prog.cpu_kernels = prog.cpu_kernels and cpu_kernels
    f = GGUFFile(path)
    w = prog.frozen_gguf(f, name)
    xp = prog.param("x", x)
    y = xp.matmul_t(w)
    rt = prog.constant("r", r)
    ce = prog.scalar_loss((y * rt).sum())
    trainer = prog.trainer(ce, "bias_corrected")
    trainer.grads_only({})
    # read before another graph runs: off the cpu a gradient is a node of the backward graph, in
    # the compute buffer the next graph reuses
    dx = prog.read(trainer.grad_acc["x"])
    kernels = {ffi.string(lib.th_kernel_name(lib.ggml_graph_node(trainer.gb_grad, i))).decode()
               for i in range(lib.ggml_graph_n_nodes(trainer.gb_grad))
               if lib.th_kernel_name(lib.ggml_graph_node(trainer.gb_grad, i)) != ffi.NULL}
    fwd = prog.forward({"y": y}).run({})["y"]
    return fwd, dx, kernels


@pytest.mark.parametrize("dtype", FROZEN_NAMES)
def test_frozen_product_and_input_gradient_match_numpy(bases, dtype):
    """Forward y = x W^T and input gradient dy W of every type against float64 numpy on the
    gguf-py dequantized W; the same bits at 1 and 2 threads."""
    rng = np.random.default_rng(0)
    for name in ("blk.0.ffn_down.weight", "blk.0.attn_k.weight", "token_embd.weight"):
        with GGUFFile(bases[dtype]) as f:
            info = f.tensor(name)
            w = dequantize(info.raw_bytes(), info.ggml_type, info.shape).astype(np.float64)
        x = rng.standard_normal((37, w.shape[1])).astype(np.float32)
        r = rng.standard_normal((37, w.shape[0])).astype(np.float32)
        y1, dx1, kernels = frozen_product(bases[dtype], name, 1, x, r)
        y2, dx2, _ = frozen_product(bases[dtype], name, 2, x, r)
        assert rel_err(y1, x.astype(np.float64) @ w.T) < 1e-5, (dtype, name)
        assert rel_err(dx1, r.astype(np.float64) @ w) < 1e-5, (dtype, name)
        assert np.array_equal(y1, y2) and np.array_equal(dx1, dx2), "bits moved with the thread count"
        want = {"sgemm"} if dtype == "f32" else {"frozen_matmul", "frozen_out_prod"}
        assert want <= kernels, kernels


@pytest.mark.parametrize("name", ["q4_k", "q8_0", "f16"])
def test_quantize_in_chunks_across_threads_gives_each_rows_own_bytes(name):
    """quant.quantize hands chunks of rows to threads: every row's bytes are the ones it gets
    quantized alone, the last chunk a partial one."""
    from toyharness.engine.quant import QUANTIZE_CHUNK_ROWS

    rows = 2 * QUANTIZE_CHUNK_ROWS + 37
    a = np.random.default_rng(2).standard_normal((rows, 256)).astype(np.float32)
    alone = np.concatenate([quantize(a[i:i + 1], name) for i in range(rows)])
    assert np.array_equal(quantize(a, name), alone)


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_without_the_cpu_kernels_the_weight_is_dequantized_in_the_graph(bases, dtype):
    """The route other backends take (a program without the cpu kernels): a GET_ROWS of all
    rows dequantizes W into the graph, then f32 products (ggml's own kernels here)."""
    rng = np.random.default_rng(2)
    name = "blk.0.ffn_up.weight"
    with GGUFFile(bases[dtype]) as f:
        info = f.tensor(name)
        w = dequantize(info.raw_bytes(), info.ggml_type, info.shape).astype(np.float64)
    x = rng.standard_normal((21, w.shape[1])).astype(np.float32)
    r = rng.standard_normal((21, w.shape[0])).astype(np.float32)
    y, dx, kernels = frozen_product(bases[dtype], name, 2, x, r, cpu_kernels=False)
    assert not kernels
    assert rel_err(y, x.astype(np.float64) @ w.T) < 1e-5 and rel_err(dx, r.astype(np.float64) @ w) < 1e-5


def needs_cuda():
    return needs("cuda")


@pytest.mark.parametrize("backend,dtype", [pytest.param(b, t, marks=needs(b), id=f"{b}-{t}")
                                           for b in ("cuda", "vulkan") for t in FROZEN_NAMES])
def test_frozen_product_and_input_gradient_on_a_gpu(bases, backend, dtype):
    """On cuda and vulkan the weight is uploaded in its type and dequantized in the graph
    (GET_ROWS): the same products, the input gradient included (ggml's OUT_PROD there takes
    only f32)."""
    rng = np.random.default_rng(0)
    for name in ("blk.0.ffn_down.weight", "token_embd.weight"):
        with GGUFFile(bases[dtype]) as f:
            info = f.tensor(name)
            w = dequantize(info.raw_bytes(), info.ggml_type, info.shape).astype(np.float64)
        x = rng.standard_normal((37, w.shape[1])).astype(np.float32)
        r = rng.standard_normal((37, w.shape[0])).astype(np.float32)
        y, dx, _ = frozen_product(bases[dtype], name, None, x, r, backend=backend)
        assert rel_err(y, x.astype(np.float64) @ w.T) < 1e-5, (dtype, name)
        assert rel_err(dx, r.astype(np.float64) @ w) < 1e-5, (dtype, name)


@pytest.mark.parametrize("gpu,dtype", [pytest.param("cuda", t, marks=needs("cuda"), id=f"cuda-{t}")
                                       for t in ("q4_k", "q8_0", "q4_1", "f16")]
                         + [pytest.param("vulkan", t, marks=needs("vulkan"), id=f"vulkan-{t}") for t in QUANTIZED])
def test_lora_on_a_quantized_base_on_a_gpu_repeats_and_agrees_with_cpu(bases, gpu, dtype):
    runs = {}
    for backend in (gpu, gpu, "cpu"):
        rec = Losses()
        train("lora", steps=6, backend=backend, sets=STEPS + [f"base={bases[dtype]}"], out=None, progress=False,
              write_files=False, observers=(rec,))
        runs.setdefault(backend, []).append(rec.losses)
    assert [np.float32(x).tobytes() for x in runs[gpu][0]] == [np.float32(x).tobytes() for x in runs[gpu][1]]
    cuda, cpu = np.array(runs[gpu][0], np.float64), np.array(runs["cpu"][0], np.float64)
    assert float(np.max(np.abs(cuda - cpu) / cpu)) < 1e-4, (cuda, cpu)
    assert cuda[-1] < cuda[0]


def test_ggml_quantize_round_trips_through_gguf_py():
    """ggml's quantizer (quant.quantize) and gguf-py's dequantizer agree on the block layout:
    values come back within each type's rounding."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((4, 512)).astype(np.float32)
    tolerance = {"f32": 0, "f16": 1e-3, "bf16": 1e-2, "q8_0": 2e-2, "q6_k": 5e-2, "q5_0": 0.1, "q5_1": 0.1,
                 "q5_k": 0.1, "q4_0": 0.25, "q4_1": 0.25, "q4_k": 0.25}
    for name in FROZEN_NAMES:
        q = FROZEN[name]
        raw = quantize(a, name)
        assert raw.shape == (4, q.row_bytes(512))
        back = dequantize(raw.reshape(-1), q.ggml_type, a.shape)
        assert np.max(np.abs(back - a)) <= tolerance[name] * np.max(np.abs(a)), name


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_lora_on_a_quantized_base_trains_and_matches_its_dequantized_f32_model(bases, dtype, tmp_path):
    """A few LoRA steps over each type lower the loss, and the first losses are those of an f32
    base holding the dequantized weights (the activations are never quantized)."""
    with GGUFFile(bases[dtype]) as f:
        deq = {n: f.tensor(n).to_numpy() for n in f.names}
        meta = {k: v for k, v in f.metadata().items() if k != "general.architecture"}
    f32 = write_gguf(tmp_path / "dequantized.gguf", "llama", deq, meta)
    sets = STEPS + ["targets=q,v,down", "rank=4"]
    train("lora", steps=6, sets=sets + [f"base={bases[dtype]}"], out=str(tmp_path / "q"), progress=False,
                write_files=False, observers=(rec := Losses(),))
    train("lora", steps=2, sets=sets + [f"base={f32}"], out=str(tmp_path / "f"), progress=False,
                write_files=False, observers=(ref_rec := Losses(),))
    assert rec.losses[-1] < rec.losses[0] - 0.05, rec.losses
    for a, b in zip(rec.losses[:2], ref_rec.losses):
        assert abs(a - b) <= 1e-5 * abs(b), (rec.losses[:2], ref_rec.losses)


class Losses:
    from toyharness.hookspecs import hookimpl

    def __init__(self):
        self.losses = []

    @hookimpl
    def step_end(self, run, step, loss, lr, ms, tokens_per_s):
        self.losses.append(loss)


def test_lora_losses_do_not_depend_on_the_thread_count(bases, tmp_path):
    runs = []
    for threads in (1, 2):
        rec = Losses()
        train("lora", steps=3, threads=threads, sets=STEPS + [f"base={bases['q4_k']}"],
              out=str(tmp_path / str(threads)), progress=False, write_files=False, observers=(rec,))
        runs.append([np.float32(x).tobytes() for x in rec.losses])
    assert runs[0] == runs[1]


def test_unsupported_type_exits_2_naming_file_tensor_and_type(base_f32, tmp_path):
    bad = copy_gguf_as(base_f32, tmp_path / "iq4.gguf", "iq4_nl")
    res = subprocess.run([sys.executable, "-m", "toyharness.cli", "run", "lora", "--steps", "1", "--set",
                          f"base={bad}", "--out", str(tmp_path / "r")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert str(bad) in res.stderr and "tensor 'token_embd.weight' has type iq4_nl" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_rows_that_do_not_fill_blocks_are_named(tmp_path):
    path = tmp_path / "odd.gguf"
    write_gguf(path, "llama", {"w.weight": np.zeros((2, 48), np.float32)})
    with GGUFFile(path) as f:
        info = f.tensor("w.weight")
        info.ggml_type = FROZEN["q4_k"].ggml_type    # a header that claims q4_k for 48-wide rows
        with pytest.raises(GGUFError, match="rows of 48 values, not a multiple of its block of 256"):
            info.check_frozen()


@pytest.mark.parametrize("dtype", ["q4_1", "q6_k", "bf16"])
def test_warm_start_takes_a_donor_of_any_type(bases, dtype):
    from toyharness_recipes.warm_start import WarmStartWindow

    from toyharness.discovery import get_recipe
    from toyharness.runner import resolve_options

    _, obj = get_recipe("warm_start")
    o = resolve_options(obj, None, ["n_layer=1", "d_model=32", "n_head=2", "n_kv_head=1", "d_ff=48",
                                    f"donor={bases[dtype]}", "donor_d_in=256"], {})
    window = WarmStartWindow(obj, o, 200)
    window.warm()
    with GGUFFile(bases[dtype]) as f:
        info = f.tensor("token_embd.weight")
        rows = dequantize(info.raw_bytes(), info.ggml_type, info.shape)[:200]
    np.testing.assert_array_equal(window.params["token_embd.weight"], rows)


def write_random_llama(path, layers: int, dtype: str, d: int = 1024, d_ff: int = 2816, vocab: int = 256):
    """A llama GGUF of random weights (std 0.02) with its matrices in `dtype`."""
    import gguf

    from toyharness.architectures import LLAMA, example_shape
    from toyharness.engine.gguf_io import _write_atomic

    rng = np.random.default_rng(layers)
    shapes = LLAMA.tensor_shapes(example_shape("llama", layers, d, 8, 4, d_ff=d_ff, vocab=vocab), [])
    qtype = gguf.GGMLQuantizationType[dtype.upper()]
    tensors = [(n, np.ones(s, np.float32), None) if len(s) == 1 else
               (n, quantize(rng.standard_normal(s, dtype=np.float32) * 0.02, dtype), qtype) for n, s in shapes.items()]
    meta = {"llama.block_count": layers, "llama.embedding_length": d, "llama.feed_forward_length": d_ff,
            "llama.attention.head_count": 8, "llama.attention.head_count_kv": 4,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.context_length": 64}
    return _write_atomic(path, "llama", meta, tensors)


MEASURE_LORA_MEMORY = """
import sys
from toyharness.engine import get_engine
from toyharness.hookspecs import plugin_manager
from toyharness.discovery import get_recipe
from toyharness.runner import batch_for, load_data, resolve_options
def anon():
    for line in open('/proc/self/status'):
        if line.startswith('RssAnon'):
            return int(line.split()[1]) * 1024
_, obj = get_recipe('lora')
opts = resolve_options(obj, None, ['base=' + sys.argv[1], 't_seq=16', 't_batch=2', 'targets=q,v'], {})
pm = plugin_manager(obj)
data = load_data(pm, opts)
batches = [batch_for(data, 'train', i, opts) for i in range(2)]
engine = get_engine('cpu', 2)
before = anon()
model = pm.hook.realize(engine=engine, options=opts, data=data)
for i in range(2):
    pm.hook.step(model=model, batch=batches[i], hp=pm.hook.hp(options=opts, step=i))
prog = model.trainer.prog
print(anon() - before - prog.persistent_bytes() - prog.compute_buffer_bytes())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads RssAnon from /proc/self/status (Linux)")
def test_quantized_base_stays_a_mapped_file(tmp_path):
    """LoRA over q4_k bases of 4 and 8 layers: the anonymous memory a step leaves beyond the
    program's own buffers (adapters, moments, activations) grows by less than 10% of what the
    four more layers add to the file. An f32 copy of them would add 7x that; the rest (ggml's
    graph bookkeeping, OpenBLAS and tile buffers) does not depend on the weights' size."""
    grown, sizes = {}, {}
    for layers in (4, 8):
        path = write_random_llama(tmp_path / f"base{layers}.gguf", layers, "q4_k")
        sizes[layers] = path.stat().st_size
        res = subprocess.run([sys.executable, "-c", MEASURE_LORA_MEMORY, str(path)], capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, res.stderr
        grown[layers] = int(res.stdout.strip().splitlines()[-1])
    extra_file, extra_memory = sizes[8] - sizes[4], grown[8] - grown[4]
    print(f"beyond the program's buffers: {grown[4] / 1e6:.1f} MB (4 layers, {sizes[4] / 1e6:.1f} MB file), "
          f"{grown[8] / 1e6:.1f} MB (8 layers, {sizes[8] / 1e6:.1f} MB file)")
    assert extra_memory < 0.1 * extra_file, f"{extra_memory / 1e6:.1f} MB more for {extra_file / 1e6:.1f} MB more file"


def test_wide_products_take_wide_tiles_fixed_by_the_shape():
    """th_frozen_tile: the widest tile (512, 256, 128) that leaves 16 tasks, else the narrow 64;
    the cut reads the shape alone (never the thread count)"""
    assert lib.th_frozen_tile(576, 1024) == 64           # SmolLM2's width: its tiles as before
    assert lib.th_frozen_tile(1536, 1024) == 128
    assert lib.th_frozen_tile(2048, 1024) == 256         # Llama-3.2-1B's width
    assert lib.th_frozen_tile(8192, 1024) == 512         # its feed-forward
    assert lib.th_frozen_tile(8192, 37) == 512 and lib.th_frozen_tile(4096, 37) == 256
    assert lib.th_frozen_tile(256, 37) == 64


@pytest.mark.parametrize("dtype", ["q4_0", "q4_k"])
def test_a_wide_frozen_product_matches_numpy_at_any_thread_count(tmp_path, dtype):
    """A product that takes the wide tiles (forward 256 rows of W, backward 256 columns summed
    over W's rows 512 at a time, a remainder of each, 3 blocks of activation rows, the last
    short) against float64 numpy, and the same bits at 1, 2 and 3 threads."""
    rng = np.random.default_rng(5)
    n, k, m = 2304, 1536, 1100
    assert lib.th_frozen_tile(n, m) == 256 and lib.th_frozen_tile(k, m) == 256
    weight = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    f32 = write_gguf(tmp_path / "w.gguf", "llama", {"w.weight": weight})
    path = copy_gguf_as(f32, tmp_path / f"w-{dtype}.gguf", dtype)
    with GGUFFile(path) as f:
        info = f.tensor("w.weight")
        w = dequantize(info.raw_bytes(), info.ggml_type, info.shape).astype(np.float64)
    x = rng.standard_normal((m, k)).astype(np.float32)
    r = rng.standard_normal((m, n)).astype(np.float32)
    y1, dx1, kernels = frozen_product(path, "w.weight", 1, x, r)
    assert {"frozen_matmul", "frozen_out_prod"} <= kernels, kernels
    assert rel_err(y1, x.astype(np.float64) @ w.T) < 1e-5
    assert rel_err(dx1, r.astype(np.float64) @ w) < 1e-5
    for threads in (2, 3):
        y, dx, _ = frozen_product(path, "w.weight", threads, x, r)
        assert np.array_equal(y, y1) and np.array_equal(dx, dx1), f"bits moved at {threads} threads"
