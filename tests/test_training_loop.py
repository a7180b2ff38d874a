"""The training loop's controls (engine/loop_controls.py, toyharness/training_loop.py): gradient
accumulation against one batch of t_batch * accumulate rows, clipping against float64 numpy,
the schedules against nanoGPT's formula, weight decay on matrices only, and the refusals."""

import json
import math
import shutil

import numpy as np
import pytest

from toyharness import blocks
from toyharness._ffi import lib
from toyharness.adamw import Schedule
from toyharness.engine import get_engine
from toyharness.engine.loop_controls import TrainingLoop
from toyharness.errors import InputError
from toyharness.goldens import golden_sets_for
from toyharness.runner import train

QUIET = ["eval_every=100", "checkpoint_every=100"]


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def relative_difference(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.abs(b)))


def golden_t_batch(recipe: str) -> int:
    return int([s for s in golden_sets_for(recipe) if s.startswith("t_batch=")][-1].split("=")[1])


@pytest.mark.parametrize("recipe,k", [("gpt2", 2), ("gpt2", 4), ("llama", 2), ("vit_tiny", 2), ("dpo", 2)])
def test_accumulated_losses_match_one_batch_of_t_batch_times_k(recipe, k, tmp_path):
    """16 steps of k micro-batches of t_batch rows against 16 steps of one t_batch * k batch (the
    same rows): the losses agree within 1e-6 relative (fp32), and so does the final eval loss."""
    t_batch, base = golden_t_batch(recipe), golden_sets_for(recipe) + QUIET
    train(recipe, steps=16, sets=[*base, f"t_batch={t_batch}", f"accumulate={k}"], out=str(tmp_path / "acc"),
          progress=False)
    train(recipe, steps=16, sets=[*base, f"t_batch={t_batch * k}"], out=str(tmp_path / "big"), progress=False)
    acc, big = metrics(tmp_path / "acc"), metrics(tmp_path / "big")
    diff = relative_difference([m["loss"] for m in acc], [m["loss"] for m in big])
    print(f"{recipe} accumulate={k} at t_batch={t_batch} vs t_batch={t_batch * k}: max relative difference {diff:.3g}")
    assert diff < 1e-6
    assert relative_difference([acc[-1]["eval_loss"]], [big[-1]["eval_loss"]]) < 1e-6
    assert acc[-1]["loss"] < acc[0]["loss"]


def test_accumulation_weights_masked_micro_batches_by_their_counted_positions(tmp_path):
    """JSONL prompt/completion data: micro-batches count different numbers of positions; the
    step's gradient and loss are those of the big batch (a mean over all counted positions),
    not a mean of the micro-batches' means."""
    data = tmp_path / "pc.jsonl"
    data.write_text("".join(json.dumps({"prompt": "q" * (1 + i % 7), "completion": "a" * (1 + (i * 5) % 11)}) + "\n"
                            for i in range(64)))
    tiny = ["n_layer=1", "d_model=32", "n_head=2", "n_kv_head=1", "d_ff=48", "t_seq=24", f"data={data}", *QUIET]
    train("llama", steps=8, sets=[*tiny, "t_batch=2", "accumulate=4"], out=str(tmp_path / "acc"), progress=False,
          save_batches=True)
    train("llama", steps=8, sets=[*tiny, "t_batch=8"], out=str(tmp_path / "big"), progress=False)
    mask = np.load(tmp_path / "acc" / "batches.npz")["mask"]
    counts = mask.reshape(8, 4, -1).sum(axis=2)
    assert (counts.min(axis=1) != counts.max(axis=1)).any(), "the micro-batches must count unequally"
    diff = relative_difference([m["loss"] for m in metrics(tmp_path / "acc")],
                               [m["loss"] for m in metrics(tmp_path / "big")])
    assert diff < 1e-6, diff


def test_resume_mid_run_with_accumulation_is_bit_identical(tmp_path):
    sets = [*golden_sets_for("gpt2"), "accumulate=2", "grad_clip=0.05", "eval_every=100", "checkpoint_every=3"]
    train("gpt2", steps=6, sets=sets, out=str(tmp_path / "full"), progress=False)
    train("gpt2", steps=3, sets=sets, out=str(tmp_path / "part"), progress=False)
    train("gpt2", steps=6, resume=str(tmp_path / "part"), progress=False)
    full, part = metrics(tmp_path / "full"), metrics(tmp_path / "part")
    assert [m["loss_hex"] for m in full] == [m["loss_hex"] for m in part]
    assert [m["grad_norm"] for m in full] == [m["grad_norm"] for m in part]


def lm_model(recipe: str, sets: list[str], loop: TrainingLoop):
    """A realized language model of the recipe at `sets`, its program made under `loop`; its data."""
    from toyharness.discovery import get_recipe
    from toyharness.hookspecs import plugin_manager
    from toyharness.runner import load_data, resolve_options

    _, obj = get_recipe(recipe)
    options = resolve_options(obj, None, sets, {})
    pm = plugin_manager(obj)
    data = load_data(pm, options)
    engine = get_engine("cpu")
    engine.set_training_loop(loop.accumulate, loop.grad_clip)
    try:
        model = pm.hook.realize(engine=engine, options=options, data=data)
    finally:
        engine.set_training_loop()
    return model, data, options


def test_compute_buffer_of_accumulation_is_one_micro_batch_not_the_big_batch():
    """accumulate=4 at t_batch=4 against t_batch=16: the training graphs' one compute buffer (read
    from the allocator after a step) holds one micro-batch's activations; the accumulators are
    persistent tensors of the parameters' size."""
    from toyharness.runner import batch_for
    from toyharness.training_loop import micro_batches, options_for_steps

    sizes = {}
    for k, t_batch in ((4, 4), (1, 16)):
        model, data, options = lm_model("gpt2", [f"t_batch={t_batch}", f"accumulate={k}", "data=synthetic"],
                                        TrainingLoop(k))
        trainer = model.trainer
        batch = batch_for(data, "train", 0, options_for_steps(options))
        for chunk in micro_batches(data, batch, k, options):
            trainer.step(chunk, options.adamw_row().hp_for_step(0))
        assert trainer.steps_done == 1 and trainer.forwards_done == k
        prog = trainer.prog
        sizes[k] = int(lib.ggml_gallocr_get_buffer_size(prog.galloc_for(trainer.gb_opt), 0))
        params = sum(p.numel() * 4 for p in prog.params.values())
        assert sum(a.numel() * 4 for a in trainer.controls.accumulators.values()) == (params if k > 1 else 0)
        prog.close()
    print(f"gpt2 training compute buffer: accumulate=4 at t_batch=4 {sizes[4]} bytes, t_batch=16 {sizes[1]} bytes")
    assert sizes[4] < 0.4 * sizes[1]


def test_forwards_done_counts_micro_batches():
    from toyharness.runner import batch_for
    from toyharness.training_loop import micro_batches, options_for_steps

    model, data, options = lm_model("gpt2", [*golden_sets_for("gpt2"), "accumulate=3"], TrainingLoop(3))
    trainer, seen = model.trainer, []
    for step in range(2):
        for chunk in micro_batches(data, batch_for(data, "train", step, options_for_steps(options)), 3, options):
            seen.append(trainer.forwards_done)
            trainer.step(chunk, options.adamw_row().hp_for_step(step))
    assert seen == [0, 1, 2, 3, 4, 5] and trainer.forwards_done == 6 and trainer.steps_done == 2
    trainer.prog.close()


# --- clipping ------------------------------------------------------------------------------------
def clip_program(threads: int, clip: float):
    """Two parameters (a matrix and a bias), mean cross-entropy over 4 classes."""
    rng = np.random.default_rng(0)
    prog = get_engine("cpu", threads).program()
    w = prog.param("w", rng.normal(size=(4, 6)).astype(np.float32))
    b = prog.param("b", rng.normal(size=(4,)).astype(np.float32))
    x = prog.input("x", (5, 6))
    loss = prog.cross_entropy(blocks.linear(x, w) + b, "targets")
    return prog, prog.trainer(loss, "constant_betas", TrainingLoop(1, clip))


@pytest.mark.parametrize("clip", [0.05, 1e6])
def test_clip_matches_float64_numpy_on_the_gradients(clip):
    """The norm over both gradients and the update AdamW makes of the clipped gradient, against
    float64 numpy (coef = C / (norm + 1e-6) clamped to 1, as clip_grad_norm_); 1e6 never clips."""
    from toyharness.adamw import constant_betas

    prog, tr = clip_program(2, clip)
    rng = np.random.default_rng(1)
    feeds = {"x": rng.normal(size=(5, 6)), "targets": rng.integers(0, 4, 5)}
    tr.grads_only(feeds)
    grads = {n: prog.read(tr.grad_acc[n]).astype(np.float64) for n in ("w", "b")}
    before = {n: prog.read(p).astype(np.float64) for n, p in prog.params.items()}
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
    coef = min(1.0, clip / (norm + 1e-6))
    row = constant_betas(lr=0.1, eps=0.5).hp_for_step(0)      # a large eps: the update follows the scale
    tr.step(feeds, row)
    assert abs(tr.grad_norm - norm) <= 1e-6 * norm
    lr, b1, b2, eps, _, s5, s6 = row
    for name, g in grads.items():
        g = g * coef
        m, v = (1 - b1) * g, (1 - b2) * g * g
        expected = before[name] - lr * (m * s5) / (np.sqrt(v * s6) + eps)
        np.testing.assert_allclose(prog.read(prog.params[name]), expected, rtol=2e-6, atol=1e-7)
    prog.close()


@pytest.mark.parametrize("extra", [[], ["accumulate=2"], ["portable=true", "accumulate=2"]])
def test_clipped_run_bits_and_norm_do_not_depend_on_the_thread_count(tmp_path, extra):
    runs = []
    for threads in (1, 2):
        out = tmp_path / f"t{threads}"
        train("gpt2", steps=4, threads=threads, sets=[*golden_sets_for("gpt2"), "grad_clip=0.05", *extra, *QUIET],
              out=str(out), progress=False)
        runs.append([(m["loss_hex"], m["grad_norm"]) for m in metrics(out)])
    assert runs[0] == runs[1]
    assert all(norm > 0.05 for _, norm in runs[0])


def test_grad_norm_reaches_observers_and_metrics_only_with_clipping(tmp_path):
    from toyharness.hookspecs import hookimpl

    seen = []

    class Watch:
        @hookimpl
        def step_end(self, step, grad_norm):
            seen.append(grad_norm)

    train("gpt2", steps=2, sets=[*golden_sets_for("gpt2"), "grad_clip=0.5", *QUIET], out=str(tmp_path / "c"),
          observers=(Watch(),), progress=False)
    assert seen == [m["grad_norm"] for m in metrics(tmp_path / "c")] and all(x > 0 for x in seen)
    seen.clear()
    train("gpt2", steps=2, sets=[*golden_sets_for("gpt2"), *QUIET], out=str(tmp_path / "p"), observers=(Watch(),),
          progress=False)
    assert seen == [None, None] and all("grad_norm" not in m for m in metrics(tmp_path / "p"))


# --- schedules and weight decay --------------------------------------------------------------------
def nanogpt_lr(it, warmup, decay_iters, lr, min_lr):
    """nanoGPT's get_lr after its warmup (its warmup is (it+1)/(warmup+1): ours is (it+1)/warmup)."""
    ratio = (it - warmup) / (decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def test_cosine_with_min_lr_is_nanogpts_and_unset_is_a_tenth_of_lr():
    set_ = Schedule("cosine", warmup=5, total=100, min_lr=1e-4)
    unset = Schedule("cosine", warmup=5, total=100)
    for step in range(5, 100):
        assert set_.learning_rate(6e-4, step) == pytest.approx(nanogpt_lr(step, 5, 100, 6e-4, 1e-4), rel=1e-12)
        assert unset.learning_rate(6e-4, step) == pytest.approx(nanogpt_lr(step, 5, 100, 6e-4, 6e-5), rel=1e-12)
    assert [set_.learning_rate(6e-4, s) for s in range(5)] == [6e-4 * (s + 1) / 5 for s in range(5)]


def test_linear_schedule_decays_from_lr_to_the_floor():
    s = Schedule("linear", warmup=2, total=12, min_lr=1e-4)
    assert s.learning_rate(1e-3, 2) == pytest.approx(1e-3)
    assert s.learning_rate(1e-3, 7) == pytest.approx(1e-4 + 0.5 * 9e-4)
    assert s.learning_rate(1e-3, 12) == pytest.approx(1e-4)
    assert Schedule("linear", warmup=0, total=10).learning_rate(1.0, 10) == pytest.approx(0.1)


DECAYED = {
    "gpt2": {"token_embd.weight", "position_embd.weight"} | {f"blk.0.{p}.weight" for p in
                                                             ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up",
                                                              "ffn_down")},
    "llama": {"token_embd.weight"} | {f"blk.0.{p}.weight" for p in
                                      ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")},
    "vit_tiny": {"patch_embd.weight", "cls_token.weight", "position_embd.weight", "output.weight"}
    | {f"blk.0.{p}.weight" for p in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up", "ffn_down")},
    "lora": {f"blk.0.{p}.weight.lora_{ab}" for p in ("attn_q", "attn_v", "ffn_down") for ab in "ab"},
    "warm_start": {"token_embd.weight", "output.weight", "lens.weight"}
    | {f"blk.0.{p}.weight" for p in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")},
}


@pytest.mark.parametrize("recipe", list(DECAYED))
def test_weight_decay_applies_to_matrices_and_embeddings_only(recipe, tmp_path):
    """The tensors each built-in recipe decays at its golden config (docs/recipes.md lists them);
    the rest (biases, norms' gains) step on the row with weight_decay 0."""
    from toyharness.discovery import get_recipe
    from toyharness.hookspecs import plugin_manager
    from toyharness.runner import load_data, resolve_options

    _, obj = get_recipe(recipe)
    options = resolve_options(obj, None, golden_sets_for(recipe), {})
    pm = plugin_manager(obj)
    model = pm.hook.realize(engine=get_engine("cpu"), options=options, data=load_data(pm, options))
    trainer = model.trainer
    assert set(trainer.decayed) == DECAYED[recipe]
    assert (trainer.hp_no_decay is None) == (len(trainer.decayed) == len(trainer.prog.params))
    trainer.prog.close()


def test_vectors_do_not_decay_in_a_step():
    """One step with weight_decay 0.5 and one with 0, from the same weights and batch: the same
    bias (a vector steps on the row without decay), a different matrix."""
    from toyharness.adamw import constant_betas

    after = []
    for wd in (0.0, 0.5):
        prog, tr = clip_program(2, 0.0)
        feeds = {"x": np.ones((5, 6)), "targets": np.arange(5) % 4}
        tr.step(feeds, constant_betas(lr=0.1, weight_decay=wd).hp_for_step(0))
        after.append({n: prog.read(p) for n, p in prog.params.items()})
        prog.close()
    assert np.array_equal(after[0]["b"], after[1]["b"])
    assert not np.array_equal(after[0]["w"], after[1]["w"])


# --- refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize("sets,message", [
    (["accumulate=0"], "option 'accumulate': must be > 0, got 0"),
    (["grad_clip=-1"], "option 'grad_clip': must be >= 0 and finite (0: off), got -1.0"),
    (["min_lr=1"], "option 'min_lr': must be in [0, lr=0.003], got 1"),
    (["lr_schedule=constant", "min_lr=1e-4"], "option 'min_lr': the constant schedule has no floor; set "
                                              "lr_schedule=cosine or linear (or leave min_lr unset)"),
])
def test_bad_loop_options_are_refused_by_name(sets, message, tmp_path):
    with pytest.raises(InputError) as err:
        train("gpt2", steps=1, sets=[*golden_sets_for("gpt2"), *sets], out=str(tmp_path / "r"), progress=False)
    assert str(err.value) == message


def test_a_step_hook_that_does_not_step_its_trainer_is_refused_with_accumulate(tmp_path, monkeypatch):
    from toyharness.discovery import get_recipe
    from toyharness.hookspecs import hookimpl

    obj = get_recipe("gpt2")[1]
    # a step hook of the recipe's own that never calls Trainer.step
    monkeypatch.setattr(type(obj), "step", hookimpl(lambda self, model, batch, hp: 1.0))
    with pytest.raises(InputError) as err:
        train("gpt2", steps=1, sets=[*golden_sets_for("gpt2"), "accumulate=2"], out=str(tmp_path / "r"),
              progress=False)
    assert str(err.value) == ("option 'accumulate': recipe gpt2's step hook did not step its trainer once per "
                              "micro-batch (Trainer.step); leave accumulate at 1")
    shutil.rmtree(tmp_path / "r", ignore_errors=True)


def test_the_clip_golden_clips_at_every_step(tmp_path):
    """gpt2@clip's bound is below the gradient norm of each of its golden steps."""
    from toyharness.goldens import golden_steps

    out = tmp_path / "clip"
    train("gpt2", steps=golden_steps("gpt2"), sets=golden_sets_for("gpt2@clip") + QUIET, out=str(out), progress=False)
    assert "grad_clip=0.05" in golden_sets_for("gpt2@clip")
    assert min(m["grad_norm"] for m in metrics(out)) > 0.05


@pytest.mark.parametrize("recipe", ["gpt2", "vit_tiny"])
def test_plan_with_accumulation_equals_ggml_buffers(recipe):
    """The plan of accumulate=2 (accumulators listed, the training buffer the largest of the three
    training graphs) equals ggml's buffers after two steps and an evaluation, to the byte."""
    from toyharness.discovery import get_recipe
    from toyharness.engine.memory_plan import plan_model
    from toyharness.hookspecs import plugin_manager
    from toyharness.runner import batch_for, load_data, resolve_options
    from toyharness.training_loop import micro_batches, options_for_steps

    _, obj = get_recipe(recipe)
    options = resolve_options(obj, None, ["accumulate=2"], {})
    pm = plugin_manager(obj)
    data = load_data(pm, options)
    engine = get_engine("cpu")
    engine.set_training_loop(2)
    try:
        plan = plan_model(recipe, pm, engine, options, data)
        model = pm.hook.realize(engine=engine, options=options, data=data)
    finally:
        engine.set_training_loop()
    for step in range(2):
        for chunk in micro_batches(data, batch_for(data, "train", step, options_for_steps(options)), 2, options):
            pm.hook.step(model=model, batch=chunk, hp=pm.hook.hp(options=options, step=step))
        pm.hook.evaluate(model=model, batch=batch_for(data, "eval", 0, options))
    prog = model.trainer.prog
    params = sum(p.numel() * 4 for p in prog.params.values())
    assert params <= plan.rows["accumulators"] < params + 64 * len(prog.params)     # each padded to its alignment
    assert plan.ggml_bytes == prog.persistent_bytes() + prog.compute_buffer_bytes()
    assert plan.rows["compute"] + plan.rows["compute_eval"] == prog.compute_buffer_bytes()
    assert "gradient sums over micro-batches (accumulate)" in plan.table()
    prog.close()


def test_accumulation_with_recomputed_blocks_gives_the_same_bits(tmp_path):
    runs = []
    for recompute in ("false", "true"):
        out = tmp_path / recompute
        train("gpt2", steps=4, sets=[*golden_sets_for("gpt2"), "accumulate=2", "grad_clip=0.05",
                                     f"recompute_blocks={recompute}", *QUIET], out=str(out), progress=False)
        runs.append([m["loss_hex"] for m in metrics(out)])
    assert runs[0] == runs[1]


def test_a_trainer_built_without_the_runs_controls_is_refused_by_name():
    from types import SimpleNamespace

    from toyharness.training_loop import check_loop_controls

    options = SimpleNamespace(accumulate=1, grad_clip=0.5)
    with pytest.raises(InputError) as err:
        check_loop_controls("mine", SimpleNamespace(loop=TrainingLoop()), options)
    assert str(err.value) == ("option 'grad_clip': recipe mine's trainer was not built with it (its program was not "
                              "made on the run's engine in realize); leave grad_clip at 0.0")
    check_loop_controls("mine", SimpleNamespace(loop=TrainingLoop(1, 0.5)), options)      # built with it: fine


def test_a_step_larger_than_the_image_data_is_refused_naming_both_options(tmp_path):
    from toyharness.images import load_image_data

    n = len(load_image_data().train_y)
    with pytest.raises(InputError) as err:
        train("vit_tiny", steps=1, sets=["t_batch=64", f"accumulate={n // 64 + 1}"], out=str(tmp_path / "r"),
              progress=False)
    assert f"training images, fewer than t_batch * accumulate {64 * (n // 64 + 1)}" in str(err.value)
