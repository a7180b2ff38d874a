"""dpo and orpo (plugins/toyharness_recipes/preference.py): the losses and metrics against float64
numpy from the model's own logits, gradients against finite differences, the reference
precomputed against in the step, bad preference data refused by name, and (marked parity, `nox -s
parity`) the first 8 losses and reward margins against TRL's loss code on transformers' model of the
dequantized base with the same adapters and AdamW rows."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import adapter_replay_start

from toyharness import InputError, seeded_model_file, synthetic_preference_file
from toyharness.data.preference import load_preference_data
from toyharness.discovery import get_recipe
from toyharness.engine import get_engine
from toyharness.lm import LanguageModel, model_tokenizer
from toyharness.options import resolve_options
from toyharness.runner import train

SMALL = ["n_layer=1", "d_model=32", "n_head=2", "n_kv_head=1", "d_ff=48", "seed=7"]
STEPS = 8


@pytest.fixture(scope="module")
def base() -> Path:
    return seeded_model_file("llama", SMALL)


@pytest.fixture(scope="module")
def pairs() -> Path:
    return synthetic_preference_file(n=24, seed=1)


def sets(base, pairs, *extra) -> list[str]:
    return [f"base={base}", f"data={pairs}", "t_seq=24", "t_batch=2", "targets=q,v,down", "rank=4", "alpha=8",
            "init_scale=3", "eval_every=100", "checkpoint_every=100", *extra]


def model_for(recipe: str, base, pairs, *extra):
    """The recipe's model on the cpu engine, its data, and its options."""
    _, obj = get_recipe(recipe)
    o = resolve_options(obj, None, sets(base, pairs, *extra), {})
    data = obj.load_data(o)
    engine = get_engine("cpu")
    engine.set_portable(False)
    return obj.realize(engine, o, data), data, o


# --- float64 numpy from the model's own logits ---------------------------------------------------
def log_softmax_pick(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    top = x.max(-1, keepdims=True)
    lse = top[..., 0] + np.log(np.exp(x - top).sum(-1))
    return np.take_along_axis(x, targets[..., None].astype(np.int64), -1)[..., 0] - lse


def numpy_values(model, batch) -> dict[str, np.ndarray]:
    """Each pair's values (PairLogps's names) in float64 from the policy's and the base's logits."""
    feeds = model._program_feeds(batch)
    b, o = model.pairs, model.options
    params = model.params()         # the adapters as trained so far
    policy = LanguageModel(model.recipe, get_engine("cpu"), o, model.vocab, params, trainable=False, batch=2 * b)
    tok = log_softmax_pick(policy.next_logits(feeds["tokens"]), feeds["targets"]) * feeds["valid"]
    comp = (tok * feeds["completion"]).sum(-1).reshape(b, 2)
    off = {k: np.zeros_like(v) if k.endswith(".lora_b") else v for k, v in params.items()}     # adapters off
    base = LanguageModel(model.recipe, get_engine("cpu"), o, model.vocab, off, trainable=False, batch=2 * b)
    ref_tok = log_softmax_pick(base.next_logits(feeds["tokens"]), feeds["targets"]) * feeds["valid"]
    ref = (ref_tok * feeds["completion"]).sum(-1).reshape(b, 2)
    counts = feeds["completion"].sum(-1).reshape(b, 2).astype(np.float64)
    return {"chosen": comp[:, 0], "rejected": comp[:, 1], "chosen_count": counts[:, 0],
            "rejected_count": counts[:, 1], "chosen_all": tok.sum(-1).reshape(b, 2)[:, 0],
            "chosen_all_count": feeds["valid"].sum(-1).reshape(b, 2)[:, 0].astype(np.float64),
            "ref_chosen": ref[:, 0], "ref_rejected": ref[:, 1]}


def log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def numpy_loss(recipe: str, v: dict, o) -> tuple[float, dict]:
    """TRL's losses and metrics (trl 1.16 dpo_trainer.py, orpo_trainer.py) in float64."""
    if recipe == "orpo":
        c, r = v["chosen"] / v["chosen_count"], v["rejected"] / v["rejected_count"]
        log_odds = (c - r) - (np.log1p(-np.exp(c)) - np.log1p(-np.exp(r)))
        nll = -v["chosen_all"].sum() / v["chosen_all_count"].sum()
        loss = nll - o.beta * log_sigmoid(log_odds).mean()
        cr, rr = o.beta * c, o.beta * r
        extra = {"nll_loss": nll, "log_odds_ratio": log_sigmoid(log_odds).mean(), "log_odds_chosen": log_odds.mean()}
        lc, lr = c, r
    else:
        cratio, rratio = v["chosen"] - v["ref_chosen"], v["rejected"] - v["ref_rejected"]
        if o.loss_type == "ipo":
            z = cratio / v["chosen_count"] - rratio / v["rejected_count"]
            loss = ((z - 1 / (2 * o.beta)) ** 2).mean()
        else:
            bz = o.beta * (cratio - rratio)
            loss = (-(1 - o.label_smoothing) * log_sigmoid(bz) - o.label_smoothing * log_sigmoid(-bz)).mean()
        cr, rr = o.beta * cratio, o.beta * rratio
        extra, lc, lr = {}, v["chosen"], v["rejected"]
    metrics = {"rewards/chosen": cr.mean(), "rewards/rejected": rr.mean(), "rewards/accuracies": (cr > rr).mean(),
               "rewards/margins": (cr - rr).mean(), "logps/chosen": lc.mean(), "logps/rejected": lr.mean(), **extra}
    return float(loss), metrics


@pytest.mark.parametrize("recipe,extra", [("dpo", []), ("dpo", ["loss_type=ipo"]), ("dpo", ["label_smoothing=0.2"]),
                                          ("orpo", [])])
def test_loss_and_metrics_match_float64_numpy(base, pairs, recipe, extra):
    model, data, o = model_for(recipe, base, pairs, "lr=2e-2", *extra)
    for i in range(3):       # the adapters move off zero, so the policy differs from the reference
        got = model.step(data.step_batch("train", i, o), o.adamw_row().hp_for_step(i))
    batch = data.step_batch("eval", 0, o)
    got = model.evaluate(batch)
    want_loss, want = numpy_loss(recipe, numpy_values(model, batch), o)
    assert got["loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    assert set(got) == {"loss", *want}
    for k, w in want.items():
        assert got[k] == pytest.approx(w, rel=1e-4, abs=1e-5), k
    assert want["rewards/margins"] != 0.0, "the adapters must have moved for the comparison to mean something"


@pytest.mark.parametrize("recipe,extra", [("dpo", []), ("dpo", ["loss_type=ipo"]), ("orpo", [])])
def test_adapter_gradients_match_finite_differences(base, pairs, recipe, extra):
    """d loss / d B for a few entries of one adapter, against central differences of the loss
    (eval, forward only) in float32; B = 0 at init, so A is moved first and B set off zero."""
    model, data, o = model_for(recipe, base, pairs, *extra)
    prog, trainer = model.prog, model.trainer
    rng = np.random.default_rng(0)
    name = "blk.0.attn_v.weight.lora_b"
    b = rng.normal(0, 0.05, prog.params[name].shape).astype(np.float32)
    prog.write(prog.params[name], b)
    batch = data.step_batch("train", 0, o)
    feeds = model.feeds(batch)
    trainer.grads_only(feeds)
    grad = prog.read(trainer.grad_acc[name])
    eps = 2e-3
    for idx in [(0, 0), (3, 1), (7, 2)]:
        plus, minus = b.copy(), b.copy()
        plus[idx] += eps
        minus[idx] -= eps
        prog.write(prog.params[name], plus)
        lp = trainer.eval_loss(feeds)
        prog.write(prog.params[name], minus)
        lm = trainer.eval_loss(feeds)
        fd = (lp - lm) / (2 * eps)
        assert grad[idx] == pytest.approx(fd, rel=3e-2, abs=3e-4), (idx, grad[idx], fd)


def test_reference_precomputed_equals_in_step(base, pairs, tmp_path):
    runs = {}
    for mode in ("in_step", "precomputed"):
        out = tmp_path / mode
        train("dpo", steps=4, sets=sets(base, pairs, "lr=2e-2", f"reference={mode}", "eval_every=2"), out=str(out),
              progress=False)
        runs[mode] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # the same values but for the matrix products' rounding: the reference rows are computed in other
    # batches (precomputed: in file order), and a product's bits may depend on its other rows
    for a, b in zip(runs["in_step"], runs["precomputed"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["logps/rejected"] == pytest.approx(b["logps/rejected"], rel=1e-6)
        for key in ("rewards/margins", "rewards/chosen"):
            assert a[key] == pytest.approx(b[key], abs=2e-6), key
    assert "eval_rewards/accuracies" in runs["precomputed"][1]


@pytest.mark.parametrize("recipe,extra", [("dpo", []), ("orpo", []), ("dpo", ["recompute_blocks=true"])])
@pytest.mark.parametrize("portable", [False, True])
def test_logits_in_pieces_keep_every_bit(base, pairs, tmp_path, recipe, extra, portable):
    """logits_chunk=7 (pieces that straddle rows, the last one short): the output head made a piece at a
    time and recomputed in the backward; every loss, metric and gradient of the whole head's, bit for bit."""
    runs = {}
    for chunk in (0, 7):
        out = tmp_path / f"{chunk}"
        train(recipe, steps=4, sets=sets(base, pairs, "lr=2e-2", f"logits_chunk={chunk}", f"portable={portable}",
                                         "eval_every=2", *extra), out=str(out), progress=False)
        runs[chunk] = [{k: v for k, v in json.loads(x).items() if k not in ("ms", "tokens_per_s", "wall_s")}
                       for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert runs[0] == runs[7] and "eval_loss" in runs[7][1]
    model, data, o = model_for(recipe, base, pairs, "logits_chunk=7", *extra)
    whole, _, _ = model_for(recipe, base, pairs, *extra)
    feeds = data.step_batch("train", 0, o)
    for m in (model, whole):
        m.trainer.grads_only(m.feeds(feeds))
    for name in model.prog.params:
        a, b = model.prog.read(model.trainer.grad_acc[name]), whole.prog.read(whole.trainer.grad_acc[name])
        assert np.array_equal(a, b), name
    assert any(np.abs(model.prog.read(model.trainer.grad_acc[n])).max() > 0 for n in model.prog.params)


def test_logits_in_pieces_shrink_the_training_buffer(tmp_path):
    """A 2,048-token vocabulary over 2 pairs of 48 positions: the head's rows x vocab tensors are most of the
    training graph's buffer; in pieces of 16 positions one piece's are alive at a time."""
    from toyharness.runner import plan_run

    big = seeded_model_file("llama", SMALL, vocab=2048)
    pairs48 = synthetic_preference_file(n=24, seed=1)
    common = [f"base={big}", f"data={pairs48}", "t_seq=48", "t_batch=2", "targets=q,v", "rank=4"]
    sizes = {}
    for chunk in (0, 16):
        plan = plan_run("dpo", sets=common + [f"logits_chunk={chunk}"])
        sizes[chunk] = plan.rows["compute"]
    assert sizes[16] < 0.5 * sizes[0], sizes


def test_logits_in_pieces_need_a_recipe_with_hidden_and_head(base, pairs):
    from toyharness.lm import LMRecipe

    _, dpo = get_recipe("dpo")
    whole_only = type("WholeForward", (type(dpo),), {"hidden": LMRecipe.hidden})()
    o = resolve_options(whole_only, None, sets(base, pairs, "logits_chunk=8"), {})
    engine = get_engine("cpu")
    engine.set_portable(False)
    with pytest.raises(InputError, match="option 'logits_chunk': recipe dpo has no hidden and head"):
        whole_only.realize(engine, o, whole_only.load_data(o))


def test_orpo_run_logs_what_trl_logs(base, pairs, tmp_path):
    seen = []

    class Watch:
        from toyharness import hookimpl

        @hookimpl
        def step_end(self, step, metrics):
            seen.append(metrics)

    train("orpo", steps=2, sets=sets(base, pairs), out=str(tmp_path / "o"), progress=False, observers=(Watch(),))
    lines = [json.loads(x) for x in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    names = {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen"}
    assert set(seen[0]) == names and names <= set(lines[0])
    assert {f"eval_{n}" for n in names} <= set(lines[-1])
    assert seen[1]["nll_loss"] == lines[1]["nll_loss"]


# --- data ----------------------------------------------------------------------------------------
def write(tmp_path, *rows) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD = {"prompt": "say hi", "chosen": " hi", "rejected": " no"}


@pytest.mark.parametrize("row,message", [
    ({"prompt": "a", "chosen": "b"}, ":2: missing key 'rejected'"),
    ({"prompt": "a", "chosen": 3, "rejected": "c"}, ":2: 'chosen' must be a string like the others, got int"),
    ({"chosen": "b", "rejected": "c"}, ":2: missing key 'prompt'"),
    ({"prompt": "a", "chosen": "b", "rejected": "c", "score": 1}, ":2: unknown key 'score'"),
    ({"chosen": [{"role": "user", "content": "x"}], "rejected": [{"role": "assistant", "content": "y"}]},
     ":2: missing key 'prompt', and 'chosen' and 'rejected' share no leading message"),
    ({"prompt": "a", "chosen": [{"role": "assistant", "content": "x"}], "rejected": [{"role": "user", "content": "y"}]},
     ":2: 'prompt' must be a list of messages like 'chosen' and 'rejected', got str"),
    ({"prompt": [{"role": "user", "content": "x"}], "chosen": [{"role": "assistant"}], "rejected": []},
     ":2: chosen[0]: missing key 'content'"),
    ({"chosen": [{"role": "bot", "content": "x"}], "rejected": [{"role": "user", "content": "y"}]},
     ":2: chosen[0] has role 'bot'"),
    ({"prompt": "a", "chosen": None, "rejected": None}, ":2: 'chosen' must be a string or a list of messages"),
])
def test_bad_records_are_refused_by_name(tmp_path, row, message):
    path = write(tmp_path, GOOD, row)
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_preference_data(path, model_tokenizer(""), 24)


def test_conversations_need_a_chat_template(tmp_path):
    conv = {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "yo"}],
            "rejected": [{"role": "assistant", "content": "no"}]}
    with pytest.raises(InputError, match=r"pairs.jsonl:1: the byte tokenizer has no chat template"):
        load_preference_data(write(tmp_path, conv, GOOD), model_tokenizer(""), 24)


def test_text_pairs_mask_the_prompt_and_truncate_like_jsonl(tmp_path):
    long = {"prompt": "p" * 20, "chosen": "c" * 20, "rejected": "r" * 3}
    lost = {"prompt": "q" * 30, "chosen": "c", "rejected": "r"}      # the prompt fills t_seq: dropped
    data = load_preference_data(write(tmp_path, GOOD, long, lost, GOOD), model_tokenizer(""), 24)
    assert (data.n_pairs, data.truncated, data.dropped) == (3, 2, 1)
    b = data.rows(np.array([0]))
    # "say hi" + " hi" in bytes (no EOS in the byte vocabulary): targets 0..7, the completion 5..7
    assert b["completion"][0, 0].tolist() == [0.0] * 5 + [1.0] * 3 + [0.0] * 16
    assert b["valid"][0, 0].tolist() == [1.0] * 8 + [0.0] * 16
    assert bytes(b["targets"][0, 0, 5:8].astype(np.uint8)).decode() == " hi"
    assert bytes(b["targets"][0, 1, 5:8].astype(np.uint8)).decode() == " no"
    cut = data.rows(np.array([1]))
    assert cut["valid"][0, 0].sum() == 24 and cut["completion"][0, 0].sum() == 24 - 19


def test_options_refused_by_name(base, pairs):
    _, dpo = get_recipe("dpo")
    for bad, message in [("pack=true", "option 'pack'"), ("mask_prompt=false", "option 'mask_prompt'"),
                         ("label_smoothing=0.1", "option 'label_smoothing': is for loss_type=sigmoid"),
                         ("reference=twice", "option 'reference'"), ("logits_chunk=-1", "option 'logits_chunk'")]:
        extra = [bad, "loss_type=ipo"] if bad.startswith("label") else [bad]
        with pytest.raises(InputError, match=message):
            resolve_options(dpo, None, sets(base, pairs, *extra), {})
    _, orpo = get_recipe("orpo")
    with pytest.raises(InputError, match="unknown option 'reference'|'reference'"):
        resolve_options(orpo, None, sets(base, pairs, "reference=in_step"), {})


# --- against TRL (nox -s parity) -----------------------------------------------------------------
def trl_replay(recipe: str, run_dir: Path, base: Path, steps: int) -> dict[str, list[float]]:
    """The first `steps` losses, reward margins and rewards of a dpo/orpo run folder (init.gguf, batches.npz)
    replayed on transformers' model of the base with the same adapters and AdamW rows, the losses
    by TRL's code: ORPOTrainer.odds_ratio_loss itself, DPO's sigmoid loss as dpo_trainer.py writes it
    (inline in DPOTrainer._compute_loss, not callable alone)."""
    import torch
    import torch.nn.functional as F
    from trl.experimental.orpo import ORPOTrainer

    from toyharness import hf_model
    from toyharness.bench.torch_side import adamw_row_step

    o, model, params, m, v, batches = adapter_replay_start(run_dir, recipe, base)
    reference = hf_model(base)
    trainer = SimpleNamespace(beta=o.beta, accelerator=SimpleNamespace(device="cpu"))
    out = {"loss": [], "rewards/margins": [], "rewards/chosen": [], "rewards/rejected": []}
    for i in range(steps):
        b = {k: torch.from_numpy(np.array(batches[k][i])) for k in batches}
        rows = b["tokens"].shape[0] * 2
        ids, targets = b["tokens"].reshape(rows, -1).long(), b["targets"].reshape(rows, -1).long()
        completion, valid = b["completion"].reshape(rows, -1), b["valid"].reshape(rows, -1)

        def logps(net, ids=ids, targets=targets, valid=valid):
            per = torch.gather(F.log_softmax(net(input_ids=ids).logits, -1), 2, targets[..., None])[..., 0]
            return per * valid

        for p in params.values():
            p.grad = None
        tok = logps(model)
        # TRL's concatenated forward is [chosen, rejected]; our rows alternate: the same per-row values
        chosen, rejected = (tok * completion).sum(-1).reshape(-1, 2).unbind(1)
        c_count, r_count = completion.sum(-1).reshape(-1, 2).unbind(1)
        if recipe == "dpo":
            with torch.no_grad():
                ref_chosen, ref_rejected = (logps(reference) * completion).sum(-1).reshape(-1, 2).unbind(1)
            # trl/trainer/dpo_trainer.py, _compute_loss: reverse_kl scores, loss_type sigmoid
            delta = (chosen - ref_chosen) - (rejected - ref_rejected)
            loss = (-F.logsigmoid(o.beta * delta)).mean()
            cr, rr = o.beta * (chosen - ref_chosen).detach(), o.beta * (rejected - ref_rejected).detach()
        else:
            # get_batch_logps(average_log_prob=True); the chosen NLL over every real target
            c_avg, r_avg = chosen / c_count, rejected / r_count
            nll = -(tok.reshape(-1, 2, tok.shape[-1])[:, 0].sum() / valid.reshape(-1, 2, valid.shape[-1])[:, 0].sum())
            ratio, cr, rr, _, _ = ORPOTrainer.odds_ratio_loss(trainer, c_avg, r_avg)
            loss = nll - ratio.mean()
        loss.backward()
        for key, value in (("loss", loss.detach()), ("rewards/margins", (cr - rr).mean()),
                           ("rewards/chosen", cr.mean()), ("rewards/rejected", rr.mean())):
            out[key].append(float(value))
        adamw_row_step(params, m, v, o.adamw_row().hp_for_step(i))
    return out


@pytest.mark.parity
@pytest.mark.parametrize("recipe", ["dpo", "orpo"])
def test_first_losses_and_margins_match_trl(tmp_path, base, pairs, recipe):
    pytest.importorskip("torch", reason="PyTorch is not installed: run `nox -s parity` (torch==2.13.0)")
    pytest.importorskip("transformers", reason="transformers is not installed: run `nox -s parity`")
    pytest.importorskip("trl", reason="trl is not installed: run `nox -s parity` (trl==1.16.0)")
    out = tmp_path / recipe
    train(recipe, steps=STEPS, sets=sets(base, pairs, "lr=5e-2", "warmup=2", "beta=0.5"), out=str(out),
          save_init=True, save_batches=True, progress=False)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    ours = {k: np.array([m[k] for m in lines], np.float64) for k in ("loss", "rewards/margins", "rewards/chosen",
                                                                      "rewards/rejected")}
    theirs = {k: np.array(v, np.float64) for k, v in trl_replay(recipe, out, base, STEPS).items()}
    loss_err = np.abs(ours["loss"] - theirs["loss"]) / np.abs(theirs["loss"])
    # A margin is a difference of the two sides' rewards, each made of sums of float32 log-probs: its
    # error is relative to the rewards it is the difference of (its plain relative error, printed
    # too, grows without bound where the sides' rewards nearly cancel; dpo's step 0 margin is 0 in
    # both, the policy being the reference there)
    margin_abs = np.abs(ours["rewards/margins"] - theirs["rewards/margins"])
    scale = np.abs(theirs["rewards/chosen"]) + np.abs(theirs["rewards/rejected"])
    margin_err = margin_abs / np.maximum(scale, 1e-30)
    plain = margin_abs / np.maximum(np.abs(theirs["rewards/margins"]), 1e-30)
    print(f"{recipe}: losses {ours['loss'][0]:.5f} -> {ours['loss'][-1]:.5f}, max relative error "
          f"{loss_err.max():.2e}; margins up to {np.abs(theirs['rewards/margins']).max():.4f}, max error "
          f"{margin_abs.max():.2e} absolute, {margin_err.max():.2e} relative to the rewards, {plain.max():.2e} "
          "relative to the margin")
    assert loss_err.max() < 2e-5, (ours["loss"], theirs["loss"])
    assert margin_err.max() < 2e-5, (ours["rewards/margins"], theirs["rewards/margins"])
    assert np.abs(theirs["rewards/margins"]).max() > 1e-3, "the policy must separate the sides for this to mean much"


# --- the sweep's table ----------------------------------------------------------------------------
def test_sweep_ranks_by_a_recipe_metric_and_refuses_unknown_ones(tmp_path):
    from toyharness.sweep.plan import DONE
    from toyharness.sweep.report import parse_rank, read_point, summarize

    _, dpo = get_recipe("dpo")
    with pytest.raises(InputError, match="--rank margins: recipe dpo logs no metric 'margins'; it logs: eval_loss"):
        parse_rank("margins", "dpo", dpo.metric_names)
    with pytest.raises(InputError, match="the order after ':' is min or max"):
        parse_rank("loss:up", "dpo", dpo.metric_names)
    rank = parse_rank("eval_rewards/accuracies:max", "dpo", dpo.metric_names)
    records = []
    for i, acc in enumerate((0.25, 0.75, 0.5)):
        run = tmp_path / str(i)
        run.mkdir()
        (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 0.69, "eval_loss": 0.7 - acc,
                                                       "eval_rewards/accuracies": acc}) + "\n")
        records.append({"status": DONE, **read_point(run)})
    points = [SimpleNamespace(index=i, config=(("beta", b),)) for i, b in enumerate((0.1, 0.2, 0.3))]
    rows = summarize(SimpleNamespace(points=points), records, rank)
    assert [r["config"]["beta"] for r in rows] == [0.2, 0.3, 0.1]
    assert [r["rank_mean"] for r in rows] == [0.75, 0.5, 0.25]
