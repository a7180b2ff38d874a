"""Preference fine-tuning: `dpo` and `orpo`, LoRA adapters on a frozen GGUF base (lora.py's
base, targets, rank, alpha and lora_dropout) trained on pairs of a prompt, a chosen and a rejected
completion (toyharness/data/preference.py has the JSONL forms; docs/preference.md).

The losses are TRL's (trl 1.16: trainer/dpo_trainer.py, experimental/orpo/orpo_trainer.py), over
each side's summed log-probability of its completion tokens (the prompt masked):

- dpo, ``loss_type=sigmoid``: z = (logp_c - ref_c) - (logp_r - ref_r),
  loss = mean(-(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z)), eps = label_smoothing
  (conservative DPO; eps = 0 is TRL's sigmoid loss);
  ``loss_type=ipo``: each side's log-ratio averaged over its completion tokens (as TRL does),
  loss = mean((z_avg - 1 / (2 beta))^2).
  The reference policy is the base with the adapters off (``reference=in_step``: a second forward
  in each step's graph; ``precomputed``: once over every pair before the first step).
- orpo: with each side's mean log-probability per completion token,
  log_odds = (lp_c - lp_r) - (log(1 - exp(lp_c)) - log(1 - exp(lp_r))),
  loss = nll - beta * mean(log sigmoid(log_odds)), nll the chosen sides' cross-entropy over every
  target (prompt included, as TRL computes it); beta is the ORPO paper's lambda (TRL's name).

Each step and evaluation logs what TRL logs: rewards/chosen, rewards/rejected, rewards/accuracies,
rewards/margins, logps/chosen, logps/rejected, and for orpo nll_loss, log_odds_ratio and
log_odds_chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from toyharness import (
    InputError,
    PairLogps,
    PreferenceModel,
    Tensor,
    cached_copy_as,
    choice,
    hookimpl,
    load_preference_data,
    seeded_model_file,
    synthetic_preference_file,
)

from .lora import AdapterOptions, AdapterRecipe

# dpo@q4_k, orpo@q4_k: the golden config over the q4_k base of lora@q4_k
GOLDEN_DATA = dict(n=48, seed=0)


@dataclass
class PreferenceOptions(AdapterOptions):
    # a JSONL file of preference pairs (toyharness/data/preference.py)
    data: str = ""
    # one pair's two sides a batch's two rows, never packed
    pack: bool = False
    lr: float = 5e-4
    beta: float = 0.1

    def validate(self) -> None:
        super().validate()
        if self.pack:
            raise self.invalid("pack", "preference pairs are one side a row, never packed; set pack=false")
        if not self.mask_prompt:
            raise self.invalid("mask_prompt", "preference losses count completion tokens only; leave it true")
        if not self.beta > 0:
            raise self.invalid("beta", f"must be > 0, got {self.beta}")


@dataclass
class DPOOptions(PreferenceOptions):
    loss_type: str = choice("sigmoid", ("sigmoid", "ipo"))
    # conservative DPO's probability that a pair's label is flipped (sigmoid only)
    label_smoothing: float = 0.0
    # the reference policy's log-probabilities: in each step's graph, or once before the first step
    reference: str = choice("in_step", ("in_step", "precomputed"))

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.label_smoothing < 0.5:
            raise self.invalid("label_smoothing", f"must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise self.invalid("label_smoothing", f"is for loss_type=sigmoid; loss_type={self.loss_type} has none, "
                               "leave it 0")


@dataclass
class ORPOOptions(PreferenceOptions):
    pass


def log_sigmoid(x: Tensor) -> Tensor:
    """log sigmoid(x) = -softplus(-x)."""
    return -((-x).softplus())


def _mean(x: Tensor) -> Tensor:
    return x.sum().scale(1.0 / x.numel())


def reward_metrics(chosen_rewards: np.ndarray, rejected_rewards: np.ndarray, logps_chosen: np.ndarray,
                   logps_rejected: np.ndarray) -> dict[str, float]:
    """TRL's rewards/* and logps/* of a batch (float32, as TRL's tensors)."""
    f = np.float32
    return {"rewards/chosen": float(chosen_rewards.mean(dtype=f)),
            "rewards/rejected": float(rejected_rewards.mean(dtype=f)),
            "rewards/accuracies": float((chosen_rewards > rejected_rewards).astype(f).mean(dtype=f)),
            "rewards/margins": float((chosen_rewards - rejected_rewards).mean(dtype=f)),
            "logps/chosen": float(logps_chosen.mean(dtype=f)), "logps/rejected": float(logps_rejected.mean(dtype=f))}


class PreferenceRecipe(AdapterRecipe):
    """What dpo and orpo share: the data, the model, steps and evaluations with their metrics."""

    golden_config: ClassVar[dict] = {**AdapterRecipe.golden_config, "t_batch": 2, "lr": 2e-3}

    @hookimpl
    def load_data(self, options):
        if not options.data:
            raise InputError(f"{self.name} needs preference pairs: --set data=PAIRS.jsonl (a line each: "
                             "{\"prompt\", \"chosen\", \"rejected\"}; docs/preference.md)")
        self.base(options)          # a missing or bad base is named first
        return load_preference_data(options.data, self.tokenizer(options), options.t_seq)

    def reference_mode(self, options) -> str | None:
        return None

    def loss(self, v: PairLogps, options) -> Tensor:
        raise NotImplementedError

    def metrics(self, v: dict[str, np.ndarray], options) -> dict[str, float]:
        raise NotImplementedError

    @hookimpl
    def realize(self, engine, options, data):
        vocab = self.vocab_for(options, data.vocab)
        return PreferenceModel(self, engine, options, vocab, self.init_params(options, vocab), data,
                               lambda v: self.loss(v, options), lambda v: self.metrics(v, options),
                               self.reference_mode(options))

    # golden: lora's config and base, on a small synthetic preference set (cached)
    @property
    def golden_sets(self) -> list[str]:
        base = seeded_model_file("llama", ["n_layer=1", "d_model=32", "n_head=2", "n_kv_head=1", "d_ff=48", "seed=7"])
        return [f"base={base}", "targets=q,v,down", "rank=4", "alpha=8",
                f"data={synthetic_preference_file(**GOLDEN_DATA)}"]

    @property
    def golden_variants(self) -> dict[str, list[str]]:
        """RECIPE@q4_k: the golden config over lora@q4_k's quantized base."""
        base = seeded_model_file("llama", ["n_layer=1", "d_model=256", "n_head=4", "n_kv_head=2", "d_ff=512",
                                           "seed=7"])
        return {"q4_k": [f"base={cached_copy_as(base, 'q4_k')}"]}

    @property
    def bench_sets(self) -> list[str]:
        return [f"base={seeded_model_file('llama', [])}", f"data={synthetic_preference_file(**GOLDEN_DATA)}",
                "t_seq=24"]


class DPO(PreferenceRecipe):
    name = "dpo"
    options_class = DPOOptions
    metric_names = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                    "logps/rejected")

    def reference_mode(self, o: DPOOptions) -> str:
        return o.reference

    def loss(self, v: PairLogps, o: DPOOptions) -> Tensor:
        chosen_ratio, rejected_ratio = v.chosen - v.ref_chosen, v.rejected - v.ref_rejected
        if o.loss_type == "ipo":    # each log-ratio averaged over its completion tokens (TRL)
            z = chosen_ratio / v.chosen_count - rejected_ratio / v.rejected_count
            return _mean(z.scale_bias(1.0, -1.0 / (2.0 * o.beta)).sqr())
        bz = (chosen_ratio - rejected_ratio).scale(o.beta)
        losses = log_sigmoid(bz).scale(-(1.0 - o.label_smoothing))
        if o.label_smoothing:
            losses = losses + log_sigmoid(-bz).scale(-o.label_smoothing)
        return _mean(losses)

    def metrics(self, v: dict[str, np.ndarray], o: DPOOptions) -> dict[str, float]:
        f = np.float32
        chosen = f(o.beta) * (v["chosen"] - v["ref_chosen"])
        rejected = f(o.beta) * (v["rejected"] - v["ref_rejected"])
        return reward_metrics(chosen, rejected, v["chosen"], v["rejected"])


class ORPO(PreferenceRecipe):
    name = "orpo"
    options_class = ORPOOptions
    metric_names = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                    "logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen")

    def loss(self, v: PairLogps, o: ORPOOptions) -> Tensor:
        chosen, rejected = v.chosen / v.chosen_count, v.rejected / v.rejected_count     # per-token means

        def log1mexp(x: Tensor) -> Tensor:      # log(1 - exp(x)), x < 0
            return x.exp().scale_bias(-1.0, 1.0).log()

        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        nll = -(v.chosen_all.sum() / v.chosen_all_count.sum())
        return nll - _mean(log_sigmoid(log_odds)).scale(o.beta)

    def metrics(self, v: dict[str, np.ndarray], o: ORPOOptions) -> dict[str, float]:
        f = np.float32
        chosen, rejected = v["chosen"] / v["chosen_count"], v["rejected"] / v["rejected_count"]
        log_odds = (chosen - rejected) - (np.log1p(-np.exp(chosen)) - np.log1p(-np.exp(rejected)))
        ratio = -np.logaddexp(f(0), -log_odds).astype(f)
        out = reward_metrics(f(o.beta) * chosen, f(o.beta) * rejected, chosen, rejected)
        out.update({"nll_loss": float(-(v["chosen_all"].sum(dtype=f) / v["chosen_all_count"].sum(dtype=f))),
                    "log_odds_ratio": float(ratio.mean(dtype=f)), "log_odds_chosen": float(log_odds.mean(dtype=f))})
        return out


dpo = DPO()
orpo = ORPO()
