"""Packed JSONL rows (toyharness/data/examples.py, toyharness/engine/packed.py): the first-fit rule,
rows bit for bit today's with pack=false, the packed step's loss and every gradient against the
unpacked step's over the same examples (cpu fast and portable; vulkan and cuda where built), the
cache of tokenized data, the metrics, and the synthetic instruction set."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from helpers import cuda_kernel_names, needs

from toyharness.cli import main
from toyharness.data.examples import first_fit_rows
from toyharness.data.instructions import synthetic_instructions, write_synthetic_instructions
from toyharness.data.jsonl import encode_example, load_jsonl, read_jsonl
from toyharness.discovery import get_recipe
from toyharness.engine import get_engine
from toyharness.lm import LanguageModel
from toyharness.options import resolve_options
from toyharness.tokenizer import ByteTokenizer


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def text_rows(lengths):
    """{"text": ...} examples of the given byte lengths (a text example counts every prediction)."""
    return [{"text": "".join(chr(97 + (i + j) % 26) for j in range(n))} for i, n in enumerate(lengths)]


# --- the rule ---------------------------------------------------------------------------------
def test_first_fit_in_file_order_starts_a_row_where_the_next_example_does_not_fit():
    # t_seq 10: 4+5 fit; 3 does not (12): new row; 7 fits with 3; 10 alone; 1, 2 together
    assert first_fit_rows(np.array([4, 5, 3, 7, 10, 1, 2]), 10).tolist() == [0, 2, 4, 5, 7]
    assert first_fit_rows(np.array([10, 10]), 10).tolist() == [0, 1, 2]


def test_packed_rows_positions_segments_and_truncation(tmp_path):
    # byte text: n bytes give n - 1 positions; t_seq 8
    data = load_jsonl(write(tmp_path / "t.jsonl", text_rows([4, 5, 20, 3, 3, 3, 3, 3, 3, 3, 9])), ByteTokenizer(),
                      8, pack=True)
    assert data.truncated == 1                      # the 20-byte example, cut to 8 positions
    assert data.n_examples == 11
    rows = data.rows(np.arange(data.n_rows))
    # train examples 0..9 (the last 10%: example 10 held out, packed apart)
    assert rows["segments"][0].tolist() == [0, 0, 0, 1, 1, 1, 1, -1]
    assert rows["positions"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert rows["segments"][1].tolist() == [0] * 8 and rows["mask"][1].sum() == 8
    assert rows["segments"][2].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert data.n_eval == 1 and rows["segments"][-1].tolist() == [0] * 8
    # inputs and targets shift by one within each example, never across
    ex = "".join(chr(97 + (1 + j) % 26) for j in range(5)).encode()
    assert rows["tokens"][0, 3:7].tolist() == list(ex[:4]) and rows["targets"][0, 3:7].tolist() == list(ex[1:5])
    assert rows["mask"][0].tolist() == [1, 1, 1, 1, 1, 1, 1, 0]


def old_rows(examples, t_seq, pad):
    """The rows as the harness made them before packing (one example a row), for the bit-for-bit check."""
    n = len(examples)
    tokens = np.full((n, t_seq), pad, np.int32)
    targets = np.full((n, t_seq), pad, np.int32)
    mask = np.zeros((n, t_seq), np.float32)
    for r, ex in enumerate(examples):
        ids = np.asarray(ex.ids, np.int64)
        k = min(len(ids) - 1, t_seq)
        if k <= 0:
            continue
        tokens[r, :k], targets[r, :k] = ids[:k], ids[1:k + 1]
        mask[r, :k] = np.asarray(ex.counts[1:k + 1], np.float32)
    keep = mask.sum(1) > 0
    return tokens[keep], targets[keep], mask[keep]


def test_pack_false_rows_are_the_rows_of_before_bit_for_bit(tmp_path):
    rows = synthetic_instructions(300, median=40, sigma=1.0, shortest=1)
    rows[3] = {"prompt": "only a prompt", "completion": ""}      # nothing counts once the prompt is masked
    path = write(tmp_path / "i.jsonl", rows)
    tok = ByteTokenizer()
    data = load_jsonl(path, tok, 64, mask_prompt=True, pack=False)
    ref = old_rows([encode_example(o, tok, True, "x") for _, o in read_jsonl(path)], 64, 0)
    for got, want in zip((data.tokens, data.targets, data.mask), ref):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    assert data.dropped == 300 - len(ref[0]) >= 1 and data.n_train + data.n_eval == len(ref[0])
    options = type("O", (), {"seed": 3, "t_batch": 5})()
    batch = data.step_batch("train", 7, options)
    assert sorted(batch) == ["mask", "targets", "tokens"]
    pick = np.random.default_rng([3, 0, 7]).integers(0, data.n_train, size=5)
    assert np.array_equal(batch["tokens"], ref[0][pick])


# --- numerical truth: packed against unpacked, the same examples ------------------------------
SHAPES = {
    "llama": ["n_layer=2", "d_model=32", "n_head=4", "n_kv_head=2", "d_ff=48", "seed=5"],
    "gpt2": ["n_layer=2", "d_model=32", "n_head=2", "seed=5"],
}


def gemma3_lora_sets() -> list[str]:
    """LoRA over lora@gemma3's seeded base: five sliding-window layers (window 4), then a global one."""
    from toyharness_recipes.lora import ARCH_GOLDEN_BASES

    from toyharness import example_file

    return [f"base={example_file(**ARCH_GOLDEN_BASES['gemma3'])}", "targets=q,k,v,o", "rank=4", "alpha=8", "seed=5"]


def unpacked_and_packed_step(recipe: str, backend: str, portable: bool = False, t_seq: int = 32,
                             lengths: list[int] | None = None, kernels: list | None = None,
                             sets: list[str] | None = None):
    """Loss and every gradient of one step over the same examples: one example a row, then packed.
    `kernels`: where given, each step's training graph's cuda kernel names (and the inputs a next
    step would feed) are appended to it;
    `sets`: the recipe's options, where not the shapes above."""
    _, obj = get_recipe(recipe)
    sets = sets or (gemma3_lora_sets() if recipe == "lora" else SHAPES[recipe])
    options = resolve_options(obj, None, sets + [f"t_seq={t_seq}"], {})
    vocab = obj.vocab_for(options, 256)
    lengths = lengths or [5, 12, 30, 3, 9, 17, 33, 8, 2, 14, 20, 6]          # 33 bytes: cut to 32 positions
    rows = [{"prompt": "p" * max(1, n // 3), "completion": "".join(chr(98 + (i * 7 + j) % 20) for j in
                                                                    range(n - max(1, n // 3)))}
            for i, n in enumerate(lengths)]
    tok = ByteTokenizer()
    examples = [encode_example(r, tok, True, "x") for r in rows]
    from toyharness.data.examples import ExampleData, TokenStore

    ids = np.concatenate([np.asarray(e.ids, np.int32) for e in examples])
    counts = np.concatenate([np.asarray(e.counts, np.uint8) for e in examples])
    offsets = np.concatenate([[0], np.cumsum([len(e.ids) for e in examples])]).astype(np.int64)
    store = TokenStore(ids, counts, offsets)
    every = {"order": np.arange(len(examples)), "truncated": 1, "dropped": 0}
    flat = ExampleData(store, 256, "x", t_seq, 0, True, False,
                       {**every, "bounds": np.arange(len(examples) + 1), "n_train": len(examples)})
    packed = ExampleData(store, 256, "x", t_seq, 0, True, True,
                         {**every, "bounds": first_fit_rows(np.minimum(np.array(lengths) - 1, t_seq), t_seq),
                          "n_train": 0})
    engine = get_engine(backend)
    engine.set_portable(portable)
    try:
        out = []
        for data in (flat, packed):
            batch = data.rows(np.arange(data.n_rows))
            params = obj.init_params(options, vocab)
            model = LanguageModel(obj, engine, options, vocab, params, batch=data.n_rows, masked=True,
                                  packed=data.packed)
            loss = model.trainer.grads_only(model.feeds(batch))
            if kernels is not None:     # and the inputs a next step feeds
                kernels.append((cuda_kernel_names(model.trainer.gb_grad), sorted(model.feeds(batch))))
            out.append((loss, {k: model.prog.read(g) for k, g in model.trainer.grad_acc.items()}, data.n_rows))
    finally:
        engine.set_portable(False)
    return out


def assert_close(a: dict, b: dict, rel: float):
    """Each gradient within rel of its largest element. The key bias's gradient is zero in exact
    arithmetic (it adds q . b_k to every score of a row, which the softmax does not see): both are
    rounding noise, held to rel of the largest gradient of all."""
    assert a.keys() == b.keys()
    top = max(float(np.abs(g).max()) for g in b.values())
    for name in a:
        if name.endswith("attn_k.bias"):
            assert max(float(np.abs(a[name]).max()), float(np.abs(b[name]).max())) <= rel * top, name
            continue
        scale = float(np.abs(b[name]).max())
        if scale == 0:      # LoRA's A while B is zero (its init): exactly zero both ways
            assert not np.any(a[name]), name
            continue
        err = float(np.abs(a[name] - b[name]).max())
        assert err <= rel * scale, f"{name}: max difference {err:.3g}, {err / scale:.3g} of its largest element"


CASES = [pytest.param("cpu", False, id="cpu-fast"), pytest.param("cpu", True, id="cpu-portable"),
         pytest.param("vulkan", False, id="vulkan", marks=needs("vulkan")),
         pytest.param("cuda", False, id="cuda", marks=needs("cuda"))]


@pytest.mark.parametrize("recipe", ["llama", "gpt2", "lora"])
@pytest.mark.parametrize("backend, portable", CASES)
def test_packed_step_loss_and_gradients_equal_the_unpacked_step(recipe, backend, portable):
    """llama: RoPE positions fed per row, grouped-query heads; gpt2: learned positions; lora over a
    gemma3 base: sliding windows (a mask of their own) measured within each example. 12 examples
    in 12 rows against the same packed into fewer: loss and each gradient within 1e-6 relative."""
    (loss_a, grads_a, rows_a), (loss_b, grads_b, rows_b) = unpacked_and_packed_step(recipe, backend, portable)
    assert rows_a == 12 and rows_b < rows_a
    assert abs(loss_a - loss_b) <= 1e-6 * abs(loss_a)
    # lora over the six-layer gemma3 base on the fast cpu path: its q and k adapters' gradients
    # come 1.3e-6 apart, where the fast path's unpacked step is itself 1.1e-6 from the portable
    # mode's (OpenBLAS's blocking follows the product's size): rounding, held to 2e-6; on cuda the
    # k adapter's come 1.14e-6 apart (an H200: cuBLAS picks its kernel by the product's size)
    fast_lora = recipe == "lora" and not portable
    assert_close(grads_b, grads_a, 2e-6 if fast_lora else 1e-6)


# examples of 1 to 140 tokens (prompt and completion) in rows of 200: the fused attention's tiles
# (64 queries or keys) lie across examples, inside one, or outside every example of their rows
LONG_LENGTHS = [70, 3, 141, 9, 40, 66, 2, 120, 17, 5, 90, 33, 64, 65, 1, 128, 12, 50]
FUSED_LLAMA = ["n_layer=2", "d_model=64", "n_head=4", "n_kv_head=2", "d_ff=96", "seed=5"]   # head size 16


@pytest.mark.parametrize("precision, rel", [("fp32", 1e-6), ("tf32", 2e-3), ("bf16", 2e-2)])
@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
def test_the_fused_attention_over_packed_rows_gives_the_unpacked_step(backend, precision, rel):
    """On cuda the fused attention takes packed rows (the fed bounds: each query's first key, each
    key's last query) and skips the tiles outside every example: llama (grouped-query heads, head
    size 16) at t_seq 200, both ways on the fused kernels. fp32: loss and gradients within 1e-6 of
    the unpacked step; tf32 and bf16 within their operands' rounding (each way rounds its own
    products)."""
    from toyharness._ffi import cuda_kernels_built

    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    engine = get_engine(backend)
    engine.set_precision(precision)
    kernels: list = []
    try:
        (loss_a, grads_a, rows_a), (loss_b, grads_b, rows_b) = unpacked_and_packed_step(
            "llama", backend, t_seq=200, lengths=LONG_LENGTHS, kernels=kernels, sets=FUSED_LLAMA)
    finally:
        engine.set_precision("fp32")
    assert rows_b < rows_a == len(LONG_LENGTHS)
    for names, _ in kernels:      # unpacked and packed alike: no softmax left to ggml
        assert {"attention", "attention_back", "attention_dq"} <= set(names), names
    # the mask read by no node is no longer made or fed; the bounds are
    assert "packed_bounds.all" in kernels[1][1] and "packed_mask.all" not in kernels[1][1]
    assert abs(loss_a - loss_b) <= rel * abs(loss_a)
    assert_close(grads_b, grads_a, rel)


def test_a_mask_that_a_graph_reads_stays_fed():
    """On the cpu every packed softmax reads its mask: after the graphs' rewrites it is still fed
    each step (the cuda attention, which reads the bounds, lets it go)."""
    _, obj = get_recipe("llama")
    options = resolve_options(obj, None, SHAPES["llama"] + ["t_seq=16"], {})
    model = LanguageModel(obj, get_engine("cpu"), options, 256, obj.init_params(options, 256), batch=2,
                          masked=True, packed=True)
    col = np.arange(16)
    batch = {"tokens": np.ones((2, 16), np.int32), "targets": np.ones((2, 16), np.int32),
             "mask": np.ones((2, 16), np.float32), "segments": np.tile(col // 5, (2, 1)).astype(np.int32),
             "positions": np.tile(col % 5, (2, 1)).astype(np.int32)}
    assert "packed_mask.all" in model.feeds(batch)
    model.trainer.grads_only(model.feeds(batch))
    assert model.prog.packed_rows.masks_read == {"packed_mask.all"}
    assert "packed_mask.all" in model.feeds(batch)


def test_the_fed_bounds_are_the_masks_first_key_and_query_end():
    """PackedRows.bounds, which the cuda kernels read instead of the mask: query i sees key j exactly
    where first[i] <= j <= i < end[j], pair by pair the mask's zeros, with and without a window."""
    from toyharness.engine.packed import PackedRows

    segments = np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2, -1, -1], [0] * 11, list(range(11))], np.int32)
    for window in (None, 3):
        rows = PackedRows(None, 3, 11)
        mask, bounds = rows.mask(segments, window)[:, 0], rows.bounds(segments, window)
        i, j = np.arange(11)[:, None], np.arange(11)[None, :]
        seen = (bounds[:, 0, :, None] <= j) & (j <= i) & (i < bounds[:, 1, None, :])
        np.testing.assert_array_equal(seen, mask == 0)


@pytest.mark.parametrize("portable", [False, True], ids=["cpu-fast", "cpu-portable"])
def test_packed_rows_longer_than_two_product_blocks_give_the_unpacked_step(portable):
    """t_seq 160: the fast path's attention products go in blocks of 64 rows or columns, each
    narrowed to its examples' terms; 12 examples in one or two packed rows."""
    (loss_a, grads_a, _), (loss_b, grads_b, rows_b) = unpacked_and_packed_step("llama", "cpu", portable, t_seq=160)
    assert rows_b <= 2
    assert abs(loss_a - loss_b) <= 1e-6 * abs(loss_a)
    assert_close(grads_b, grads_a, 1e-6)


def test_a_row_mixing_examples_without_the_mask_would_differ():
    """The check above can fail: the same packed rows with attention across examples (a plain causal
    mask, positions running on) give another loss."""
    _, obj = get_recipe("llama")
    options = resolve_options(obj, None, SHAPES["llama"] + ["t_seq=32"], {})
    tok = ByteTokenizer()
    rows = [{"prompt": "ab", "completion": "cdefgh"}, {"prompt": "xy", "completion": "cdefgh"}] * 2
    data = load_jsonl(write_rows(rows), tok, 32, pack=True)
    assert data.n_train == 1
    batch = data.rows(np.arange(1))                 # the train row: three examples
    assert batch["segments"][0].max() == 2
    engine = get_engine("cpu")
    params = obj.init_params(options, 256)
    packed = LanguageModel(obj, engine, options, 256, params, batch=1, masked=True, packed=True)
    plain = LanguageModel(obj, engine, options, 256, params, batch=1, masked=True)
    a = packed.trainer.eval_loss(packed.feeds(batch))
    b = plain.trainer.eval_loss({k: batch[k] for k in ("tokens", "targets", "mask")})
    assert abs(a - b) > 1e-4


def write_rows(rows):
    import tempfile
    from pathlib import Path

    return write(Path(tempfile.mkdtemp()) / "r.jsonl", rows)


# --- runs: metrics, the cache, the generator ---------------------------------------------------
RUN = ["--set", "n_layer=1", "--set", "d_model=32", "--set", "n_head=2", "--set", "n_kv_head=1", "--set", "d_ff=48",
       "--set", "t_seq=64", "--set", "t_batch=4", "--set", "eval_every=2"]


def test_runs_report_padding_and_counted_tokens_and_packing_cuts_padding(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TOYHARNESS_CACHE", str(tmp_path / "cache"))
    data = write_synthetic_instructions(tmp_path / "i.jsonl", 200, median=20, sigma=0.6)
    seen = {}
    for pack in ("true", "false"):
        out = tmp_path / pack
        assert main(["run", "llama", "--steps", "2", "--set", f"data={data}", "--set", f"pack={pack}", *RUN,
                     "--out", str(out), "--no-progress"]) == 0
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert all(0 <= m["padding"] < 1 and m["counted"] > 0 and m["counted_tokens_per_s"] > 0 for m in metrics)
        seen[pack] = json.loads((out / "summary.json").read_text())
    assert seen["true"]["padding"] < 0.2 < 0.5 < seen["false"]["padding"]
    summary = load_jsonl(data, ByteTokenizer(), 64, pack=True).summary()
    assert "180 train" not in summary and "packed into" in summary and "padding" in summary


def test_the_cache_gives_the_same_rows_and_a_changed_file_is_tokenized_again(tmp_path, monkeypatch):
    monkeypatch.setenv("TOYHARNESS_CACHE", str(tmp_path / "cache"))
    path = write_synthetic_instructions(tmp_path / "i.jsonl", 500)
    fresh = load_jsonl(path, ByteTokenizer(), 128, pack=True)
    first = load_jsonl(path, ByteTokenizer(), 128, pack=True, cache=True)
    again = load_jsonl(path, ByteTokenizer(), 128, pack=True, cache=True)
    entries = sorted(p.name.split("-")[0] for p in (tmp_path / "cache" / "data").iterdir())
    assert entries == ["rows", "tokens"]
    for data in (first, again):
        assert data.n_rows == fresh.n_rows
        for key in ("tokens", "targets", "mask", "positions", "segments"):
            assert np.array_equal(data.rows(np.arange(data.n_rows))[key], fresh.rows(np.arange(fresh.n_rows))[key])
    # another mask_prompt, another t_seq, an edited file: entries of their own
    load_jsonl(path, ByteTokenizer(), 128, mask_prompt=False, pack=True, cache=True)
    load_jsonl(path, ByteTokenizer(), 64, pack=True, cache=True)
    write_synthetic_instructions(path, 500, seed=1)
    edited = load_jsonl(path, ByteTokenizer(), 128, pack=True, cache=True)
    assert not np.array_equal(edited.tokens, fresh.tokens)
    names = [p.name for p in (tmp_path / "cache" / "data").iterdir()]
    assert sum(n.startswith("tokens-") for n in names) == 3 and sum(n.startswith("rows-") for n in names) == 4


def test_synthetic_instructions_have_the_documented_shape_and_are_the_same_each_time():
    rows = synthetic_instructions(4000)
    lengths = np.array([len(r["prompt"]) + len(r["completion"]) for r in rows])
    assert 140 <= np.median(lengths) <= 160
    assert 0.005 < (lengths > 1000).mean() < 0.04 and lengths.max() > 2000
    share = np.array([len(r["prompt"]) for r in rows]) / lengths
    assert share.min() >= 0.1 and share.max() <= 0.5
    assert synthetic_instructions(50) == rows[:50] and synthetic_instructions(50, seed=1) != rows[:50]


def test_load_time_of_a_cached_file_is_a_fraction_of_the_first(tmp_path, monkeypatch):
    monkeypatch.setenv("TOYHARNESS_CACHE", str(tmp_path / "cache"))
    path = write_synthetic_instructions(tmp_path / "i.jsonl", 5000)
    t0 = time.perf_counter()
    load_jsonl(path, ByteTokenizer(), 256, pack=True, cache=True)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    load_jsonl(path, ByteTokenizer(), 256, pack=True, cache=True)
    second = time.perf_counter() - t0
    assert second < first / 4, (first, second)


# --- the cpu fast path: what the block-diagonal mask hides is skipped -------------------------
def kernel_names(graph) -> list[str]:
    from toyharness._ffi import ffi, lib

    names = (lib.th_kernel_name(lib.ggml_graph_node(graph, i)) for i in range(lib.ggml_graph_n_nodes(graph)))
    return [ffi.string(n).decode() for n in names if n != ffi.NULL]


def test_packed_attention_takes_the_packed_softmax_both_ways_and_the_packed_products():
    """Per layer on the fast cpu path: the softmax and its backward skip each row's keys before its
    example (and after its diagonal), and the six products of attention their terms outside each
    tile's examples (native/cpu_kernels.c, th_packed_range)."""
    _, obj = get_recipe("llama")
    options = resolve_options(obj, None, SHAPES["llama"] + ["t_seq=32"], {})
    model = LanguageModel(obj, get_engine("cpu"), options, 256, obj.init_params(options, 256), batch=2, masked=True,
                          packed=True)
    flat = load_jsonl(write_rows(text_rows([9, 14, 5, 20, 7])), ByteTokenizer(), 32, pack=True)
    batch = flat.rows(np.array([0, 1]))
    model.trainer.grads_only(model.feeds(batch))      # the rewrite runs before a graph's first compute
    names = kernel_names(model.trainer.gb_grad)
    assert names.count("softmax packed") == names.count("softmax_back packed") == 2
    assert names.count("sgemm packed") == 2 * 6 and "sgemm causal" not in names


@pytest.mark.parametrize("T", [16, 40, 64])
def test_the_packed_softmax_skips_hidden_keys_with_the_bits_of_whole_rows(T):
    """Rows of several examples: the packed kernel (mask named packed_mask.*) against the plain
    kernel over the same mask values under another name, bit for bit, and against float64."""
    from toyharness._ffi import lib

    rng = np.random.default_rng(T)
    B, H = 2, 3
    segments = np.sort(rng.integers(0, 4, size=(B, T)), axis=1)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    seen = (segments[:, :, None] == segments[:, None, :]) & (j <= i)
    mask = np.where(seen, 0, -1e30).astype(np.float32)[:, None]
    s = rng.normal(size=(B, H, T, T)).astype(np.float32)
    prog = get_engine("cpu").program()
    x = prog.param("s", s)
    outs = {}
    for name in ("packed_mask.all", "plain_mask"):
        m = prog.input(name, (B, 1, T, T))
        # the rewrite takes a softmax as packed where the view after it reads (as attention's does)
        outs[name] = x._new(lib.ggml_soft_max_ext(x._ctx, x.ptr, m.ptr, 0.5, 0.0))
    fg = prog.forward(outs)
    got = fg.run({"packed_mask.all": mask, "plain_mask": mask})
    np.testing.assert_array_equal(got["packed_mask.all"], got["plain_mask"])
    z = np.where(seen[:, None], 0.5 * s.astype(np.float64), -np.inf)
    want = np.exp(z - z.max(-1, keepdims=True))
    assert np.abs(got["packed_mask.all"] - want / want.sum(-1, keepdims=True)).max() < 1e-6


@pytest.mark.parametrize("window", [None, 3])
def test_the_fed_mask_is_each_examples_causal_block(window):
    """PackedRows.mask (a block per example) against its definition pair by pair: query i sees key j
    when both are in one example (or both padding), j <= i, and i - j < window where there is one."""
    from toyharness.engine.packed import HIDDEN, PackedRows

    segments = np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2, -1, -1], [0] * 11, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], np.int32)
    got = PackedRows(None, 3, 11).mask(segments, window)
    i, j = np.arange(11)[:, None], np.arange(11)[None, :]
    seen = (segments[:, :, None] == segments[:, None, :]) & (j <= i) & (True if window is None else i - j < window)
    np.testing.assert_array_equal(got[:, 0], np.where(seen, 0, HIDDEN).astype(np.float32))


def test_rope_of_repeated_positions_makes_each_table_once_with_the_same_bits():
    """Packed rows rope every head's tokens as one run, positions repeating per head: the fast
    kernel then makes each position's table once (native/cpu_kernels.c, th_rope_op), with the
    bits of roping each head alone (whose positions do not repeat)."""
    rng = np.random.default_rng(1)
    heads, t, d = 6, 40, 16
    x = rng.normal(size=(heads, t, 1, d)).astype(np.float32)
    pos = np.tile(np.arange(t) % 13, heads).astype(np.int32)       # restarts within a row too
    prog = get_engine("cpu").program()
    whole = prog.constant("x", x.reshape(1, heads * t, 1, d)).rope(prog.constant("p", pos), d)
    parts = {f"h{h}": prog.constant(f"x{h}", x[h:h + 1]).rope(prog.constant(f"p{h}", pos[h * t:(h + 1) * t]), d)
             for h in range(heads)}
    got = prog.forward({"whole": whole, **parts}).run({})
    each = np.concatenate([got[f"h{h}"] for h in range(heads)])
    np.testing.assert_array_equal(got["whole"].reshape(heads, t, 1, d), each)


def test_pack_false_on_text_data_is_refused_by_name(tmp_path, capsys):
    """Text is one stream cut into rows: there are no examples for pack=false to keep a row each."""
    text = tmp_path / "corpus.txt"
    text.write_text("to be or not to be " * 50)
    assert main(["run", "gpt2", "--steps", "1", "--set", f"data={text}", "--set", "pack=false",
                 "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "option 'pack'" in err[0] and str(text) in err[0], err
    assert not (tmp_path / "run").exists()
