"""recompute_blocks (toyharness/engine/recompute.py): each block's activations recomputed in the
backward, the same loss bits as without it, less memory in the plan and in ggml's buffers; on cpu
and on cuda (there the cuda rewrite pairs each attention's fused backward with its block's
recomputed forward: checked on graphs built on the cpu as cuda builds them, and against the cuda
goldens where a device is present)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from helpers import as_cuda_builds_it, cuda_node_name, graph_nodes, needs
from plan_cases import stepped_model

from toyharness import goldens
from toyharness._ffi import ffi, lib
from toyharness.architectures import example_shape, write_example
from toyharness.discovery import get_recipe
from toyharness.engine import Program, get_engine
from toyharness.engine.allocation import graph_buffer_bytes
from toyharness.engine.memory_plan import plan_model
from toyharness.errors import InputError
from toyharness.hookspecs import plugin_manager
from toyharness.lm import seeded_model_file
from toyharness.runner import load_data, plan_run, resolve_options, train

ROOT = Path(__file__).resolve().parents[1]

STEPS = ["eval_every=2", "eval_batches=1"]


@pytest.fixture(scope="module")
def llama_base() -> str:
    return str(seeded_model_file("llama", ["n_layer=3", "d_model=64", "n_head=4", "n_kv_head=2", "d_ff=128"]))


def _losses(recipe: str, sets: list[str]) -> tuple[list[str], list[float]]:
    captured = []

    class Capture:
        from toyharness.hookspecs import hookimpl

        @hookimpl
        def run_end(self, run, summary, artifacts):
            captured.append(run)

    summary = train(recipe, steps=4, sets=sets + STEPS, write_files=False, progress=False, observers=(Capture(),))
    run = captured[0]
    return [m["loss_hex"] for m in run.metrics], [summary["eval_loss"]]


CASES = [("gpt2", ["n_layer=3"]), ("llama", ["n_layer=3"]), ("warm_start", ["n_layer=3"]), ("lora", ["t_seq=128"]),
         ("gpt2", ["n_layer=2", "portable=true"])]


@pytest.mark.parametrize("recipe,sets", CASES, ids=[f"{r}-{'-'.join(s)}" for r, s in CASES])
def test_recompute_keeps_the_loss_bits_and_saves_memory(recipe, sets, llama_base):
    if recipe == "lora":
        sets = sets + [f"base={llama_base}"]
    off, on = sets + ["recompute_blocks=false"], sets + ["recompute_blocks=true"]
    assert _losses(recipe, on) == _losses(recipe, off)
    plan_off, plan_on = plan_run(recipe, sets=off), plan_run(recipe, sets=on)
    assert plan_on.activations < plan_off.activations
    assert plan_on.total < plan_off.total


def test_recompute_is_refused_by_name_where_it_does_nothing(tmp_path):
    with pytest.raises(InputError, match="unknown option 'recompute_blocks'"):
        train("vit_tiny", steps=1, sets=["recompute_blocks=true"], write_files=False, progress=False)
    base = write_example(tmp_path / "qwen3.gguf", example_shape("qwen3"))
    with pytest.raises(InputError, match="option 'recompute_blocks': recipe lora's forward here has no blocks"):
        train("lora", steps=1, sets=[f"base={base}", "recompute_blocks=true"], write_files=False, progress=False)


def test_recompute_is_refused_on_a_backend_without_the_rewrites_it_needs(monkeypatch):
    """The metal lowering rewrites the training graph before the copies are wired in: refused by name."""
    monkeypatch.setattr(Program, "lowering_target", "metal")
    with pytest.raises(InputError, match="option 'recompute_blocks': the cpu and cuda backends only, not cpu "
                                         "lowered for metal"):
        train("gpt2", steps=1, sets=["n_layer=1", "recompute_blocks=true"], write_files=False, progress=False)


# --- cuda ------------------------------------------------------------------------------------------
def _addr(t) -> int:
    return int(ffi.cast("uintptr_t", t))


def _backward_kernels(trainer, copies: set[int]) -> Counter:
    forward = {_addr(t) for t in graph_nodes(trainer.gf)}
    # what computes (the rebuilt graphs drop views and no-ops nothing reads: recompute._dead_views)
    return Counter(cuda_node_name(t) for t in graph_nodes(trainer.gb_opt)
                   if _addr(t) not in forward and _addr(t) not in copies
                   and cuda_node_name(t) not in ("RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE", "NONE"))


CUDA_SHAPES = [("gpt2", ["n_layer=2"], "fp32"), ("llama", ["n_layer=2", "n_head=4", "n_kv_head=2"], "tf32"),
               ("lora", ["t_seq=64", "targets=q,k,v,o,gate,up,down"], "bf16")]


@pytest.fixture(scope="module")
def q4_k_base() -> str:
    """A two-block llama base quantized to Q4_K (rows of 256 for K-quants): lora@q4_k's golden
    base has one block, which recompute cannot shrink."""
    from toyharness.engine.gguf_io import cached_copy_as

    base = seeded_model_file("llama", ["n_layer=2", "d_model=256", "n_head=4", "n_kv_head=2", "d_ff=512", "seed=7"])
    return str(cached_copy_as(base, "q4_k"))


@pytest.fixture(scope="module")
def wide_head_base() -> str:
    """q4_k_base's shape over a vocabulary of 4096: the output head's logits outweigh a block."""
    from toyharness.engine.gguf_io import cached_copy_as

    base = seeded_model_file("llama", ["n_layer=2", "d_model=256", "n_head=4", "n_kv_head=2", "d_ff=512", "seed=7"],
                             vocab=4096)
    return str(cached_copy_as(base, "q4_k"))


@pytest.mark.parametrize("name,sets,precision", CUDA_SHAPES, ids=[c[0] for c in CUDA_SHAPES])
def test_on_cuda_each_attention_backward_reads_its_blocks_recomputed_forward(name, sets, precision, monkeypatch,
                                                                              q4_k_base):
    """Built on cpu as cuda builds it: with recompute, the backward holds the same kernels as
    without (attention's fused prep, backward and dQ; GELU's, LayerNorm's, SwiGLU's, the frozen
    products'), and each fused prep and backward reads a recomputed fused forward that comes before
    it, never the original forward (which then dies in the forward: the training graph's buffer
    shrinks). The rewrite run again on both rebuilt graphs finds every node marked and its
    per-graph checks pass (no node reads a folded one, copies and rooms in order)."""
    recipe = name
    if recipe == "lora":       # at bf16 the base's products are the frozen bf16 nodes (th-frozen.cu)
        sets = sets + [f"base={q4_k_base}"]
    base_prog, base_trainer, engine = as_cuda_builds_it(recipe, sets + ["recompute_blocks=false"], precision,
                                                         monkeypatch)
    prog, trainer, _ = as_cuda_builds_it(recipe, sets + ["recompute_blocks=true"], precision, monkeypatch)
    copies = {_addr(t) for t in prog.recompute.copies.values()}
    assert _backward_kernels(trainer, copies) == _backward_kernels(base_trainer, set())
    order = {_addr(t): i for i, t in enumerate(graph_nodes(trainer.gb_opt))}
    fused_backward = 0
    for i, t in enumerate(graph_nodes(trainer.gb_opt)):
        if cuda_node_name(t) in ("attention_prep", "attention_back"):
            fwd = lib.th_tensor_src(t, 1 if cuda_node_name(t) == "attention_prep" else 4)
            assert cuda_node_name(fwd) == "attention" and _addr(fwd) in copies and order[_addr(fwd)] < i
            fused_backward += 1
    blocks = prog.recompute.blocks
    assert blocks >= 1 and fused_backward == 2 * blocks
    forwards = [t for t in graph_nodes(trainer.gb_opt) if cuda_node_name(t) == "attention"]
    assert len(forwards) == 2 * blocks and sum(_addr(t) in copies for t in forwards) == blocks
    for graph in (trainer.gb_grad, trainer.gb_opt):
        # no slice out of a prep node: dK and dV go to rooms the backward fills in place (llama's
        # and lora's grouped heads: each group's sums, into the REPEAT_BACKs' nodes that summed them)
        assert not [t for t in graph_nodes(graph) if cuda_node_name(t) in ("slice", "slice_cont")
                    and cuda_node_name(lib.th_tensor_src(t, 0)) == "attention_prep"]
    assert lib.th_cuda_rewrite(trainer.gb_opt, 1) == 0 and lib.th_cuda_rewrite(trainer.gb_grad, 1) == 0
    if precision != "fp32":        # every product of the copies carries the program's precision stamp
        stamps = {lib.th_cuda_precision_of(t) for t in graph_nodes(trainer.gb_opt)
                  if cuda_node_name(t) in ("MUL_MAT", "OUT_PROD")}
        assert stamps == {lib.th_cuda_precision_of(forwards[-1])}
    assert graph_buffer_bytes(engine, trainer.gb_opt) < graph_buffer_bytes(engine, base_trainer.gb_opt)
    prog.close()
    base_prog.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_on_cuda_a_chunked_head_recomputes_beside_the_blocks(precision, monkeypatch, wide_head_base):
    """dpo with recompute_blocks and logits_chunk, built on cpu as cuda builds it: the head's pieces
    and the blocks recomputed in one training graph, the rewrite's checks passing on each graph (a
    piece's copies read the blocks' originals; rewritten beside the blocks' copies, the cuda rewrite
    refused the graph). Every piece's pick has a copy, and over a head that outweighs a block the
    graph's buffer is smaller than with the blocks alone recomputed."""
    from toyharness import synthetic_preference_file

    sets = [f"base={wide_head_base}", f"data={synthetic_preference_file(n=24, seed=1)}", "t_seq=48", "t_batch=2",
            "targets=q,v", "rank=4", "recompute_blocks=true"]
    blocks_prog, blocks_trainer, engine = as_cuda_builds_it("dpo", sets, precision, monkeypatch)
    prog, trainer, _ = as_cuda_builds_it("dpo", sets + ["logits_chunk=48"], precision, monkeypatch)
    assert len(prog.recompute.outputs["always"]) == 4 and prog.recompute.outputs["blocks"]
    assert lib.th_cuda_rewrite(trainer.gb_opt, 1) == 0 and lib.th_cuda_rewrite(trainer.gb_grad, 1) == 0
    assert graph_buffer_bytes(engine, trainer.gb_opt) < graph_buffer_bytes(engine, blocks_trainer.gb_opt)
    prog.close()
    blocks_prog.close()


def _kept_softmaxes(graph) -> int:
    return sum(1 for t in graph_nodes(graph) if ffi.string(lib.ggml_op_desc(t)).decode() == "SOFT_MAX"
               and lib.th_tensor_flags(t) & 2)      # GGML_TENSOR_FLAG_OUTPUT: ggml-alloc never frees it


@pytest.mark.parametrize("mode", ["fast", "portable", "cuda", "ggml"])
def test_a_softmax_is_kept_for_its_backward_only_where_the_kernel_overwrites_it(mode, monkeypatch, q4_k_base):
    """dpo's picks: SOFT_MAX_BACK's gradient arrives as a view, so ggml-alloc may give dx the softmax's
    buffer. ggml's cpu kernel (`ggml`: a cpu program without our kernels) then reads what it wrote, and
    the softmax is kept as an output, to the graph's end; ours (fast, portable) and ggml-cuda's read a
    row before writing it, and keep nothing (with logits_chunk, every piece's probabilities stayed:
    2 GiB at the 1B race's shape)."""
    from toyharness import synthetic_preference_file

    sets = [f"base={q4_k_base}", f"data={synthetic_preference_file(n=24, seed=1)}", "t_seq=48", "t_batch=2",
            "targets=q,v", "rank=4", "logits_chunk=48"]
    if mode == "cuda":
        prog, trainer, _ = as_cuda_builds_it("dpo", sets, "fp32", monkeypatch)
    else:
        if mode == "ggml":
            real_choose = Program._choose_kernels

            def choose(self, engine):
                real_choose(self, engine)
                self.cpu_kernels = self.cpu_folds = self.kv_in_place = False

            monkeypatch.setattr(Program, "_choose_kernels", choose)
        _, obj = get_recipe("dpo")
        options = resolve_options(obj, None, sets, {})
        pm = plugin_manager(obj)
        engine = get_engine("cpu")
        monkeypatch.setattr(engine, "portable", mode == "portable")
        trainer = pm.hook.realize(engine=engine, options=options, data=load_data(pm, options)).trainer
        prog = trainer.prog
    assert _kept_softmaxes(trainer.gb_grad) == (4 if mode == "ggml" else 0)     # one a piece
    prog.close()


# The cuda goldens of the recipes that recompute blocks (lora over llama-family bases), each
# precision: with recompute on, the same bits.
CUDA_GOLDENS = ["gpt2", "llama", "warm_start", "lora", "lora@q4_k", "lora@q8_0", "gpt2@tf32", "llama@tf32",
                "lora@tf32", "gpt2@bf16", "llama@bf16", "warm_start@bf16", "lora@bf16", "lora@q4_k@bf16",
                "lora@q8_0@bf16"]


@pytest.mark.parametrize("name", [pytest.param(n, marks=needs("cuda")) for n in CUDA_GOLDENS])
def test_recompute_on_cuda_keeps_each_goldens_bits(name):
    path, _ = goldens.resolve(name, "cuda", ROOT / "goldens")
    assert path.is_file(), path
    doc = goldens.compute(name, "cuda", extra_sets=["recompute_blocks=true"])
    assert doc["options"]["recompute_blocks"] is True
    mismatch = goldens.compare(goldens.load(path), doc)
    assert mismatch is None, str(mismatch)


PLAN_CASES = [("llama", ["n_layer=3"]), ("lora", ["t_seq=128", "precision=bf16"])]


@pytest.mark.parametrize("recipe,sets", [pytest.param(*c, marks=needs("cuda")) for c in PLAN_CASES],
                         ids=[c[0] for c in PLAN_CASES])
def test_recompute_on_cuda_plans_less_and_the_plan_is_ggmls_buffers(recipe, sets, llama_base):
    """The cuda plan with recompute: fewer activations kept and a smaller total than without, and
    still ggml's buffers to the byte after a step, an evaluation and a step."""
    if recipe == "lora":
        sets = sets + [f"base={llama_base}"]
    _, obj = get_recipe(recipe)
    plans = {}
    for on in (False, True):
        options = resolve_options(obj, None, sets + [f"recompute_blocks={str(on).lower()}"], {})
        pm = plugin_manager(obj)
        data = load_data(pm, options)
        engine = get_engine("cuda")
        engine.set_precision(options.precision)
        plans[on] = plan = plan_model(recipe, pm, engine, options, data)
        prog = stepped_model(pm, engine, options, data).trainer.prog
        assert sorted(plan.buffers) == sorted(prog.buffer_sizes())
        prog.close()
    print(f"{recipe} on cuda: activations {plans[False].activations / 2**20:.1f} -> "
          f"{plans[True].activations / 2**20:.1f} MiB, total {plans[False].total / 2**20:.1f} -> "
          f"{plans[True].total / 2**20:.1f} MiB")
    assert plans[True].activations < plans[False].activations and plans[True].total < plans[False].total


KEEP_RUN = """
import json, sys
from toyharness._ffi import ffi, lib
from toyharness.hookspecs import hookimpl
from toyharness.runner import train

runs = []


class Capture:
    @hookimpl
    def run_end(self, run, summary, artifacts):
        runs.append(run)


train("lora", steps=4, backend="cuda", sets=json.loads(sys.argv[1]), write_files=False, progress=False,
      observers=(Capture(),))
converted, reused = ffi.new("int64_t *"), ffi.new("int64_t *")
lib.th_cuda_bf16_copies(converted, reused)
print(json.dumps({"hex": [m["loss_hex"] for m in runs[0].metrics], "converted": converted[0], "reused": reused[0],
                  "chunks": lib.th_cuda_bf16_copy_bytes()}))
"""


def _keep_run(sets: list[str]) -> dict:
    """lora at bf16 in a fresh process (the copies and their chunks are the process's): its losses'
    bits and its operands' conversions."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", KEEP_RUN, json.dumps(sets)], capture_output=True, text=True,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
def test_on_cuda_recompute_drops_bf16_copies_past_their_horizon_and_keeps_the_bits(backend, q4_k_base):
    """With recompute the bf16 operand copies go once no node within 256 (BF16_KEEP_NODES)
    reads their source (th-precision.cu): a frozen weight's copy from the forward is converted again
    by its block's recomputed forward. Without recompute too (a base kept in its type): its copies go
    before the backward, which converts them again. The losses keep their bits with recompute and
    without, and copies are reused either way."""
    sets = [f"base={q4_k_base}", "t_seq=64", "targets=q,k,v,o", "rank=16", "precision=bf16"]
    plain = _keep_run(sets + ["recompute_blocks=false"])
    horizon = _keep_run(sets + ["recompute_blocks=true"])
    print(f"lora@q4_k at bf16: operands converted {horizon['converted']} (reused {horizon['reused']}) with "
          f"recompute, chunks {horizon['chunks']} bytes; without recompute {plain['converted']} ({plain['reused']}), "
          f"chunks {plain['chunks']} bytes")
    assert horizon["hex"] == plain["hex"]
    assert horizon["reused"] > 0 and plain["reused"] > 0
