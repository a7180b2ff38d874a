"""A DPO step, ours against TRL's: ms per step and peak GPU memory on the same batch of pairs.

    python tools/dpo_race.py [--backend cuda] [--steps 10] [--t-seq 1024] [--t-batch 2] \
        [--vocab 128256] [--trl-wheels DIR] [--sides ours,ours-recompute,trl,trl-no-gc]

The base: Llama-3.2-1B's shape (16 layers, d_model 2048, 32 query and 8 key/value heads, d_ff 8192,
Llama 3's rope scaling) with its vocabulary of 128,256 (--vocab for another), seeded weights (std
0.02) quantized to Q4_K by ggml's quantizer (tools/arch_bench.py's seeded_base, kept in the
cache). Its tokenizer is the harness's byte vocabulary, so the data is bytes.

The data: --t-batch pairs of a prompt and two completions, each side longer than t_seq + 1 tokens,
so every row is full and cut at the end (no padding on either side). Both sides step on the same
pairs every step, tokenized once by our loader (toyharness/data/preference.py); TRL gets those token
ids (its own tokenization is skipped: `_prepare_dataset` returns the ids given) and truncates them
to max_length = t_seq + 1, the t_seq + 1 tokens a row of ours reads (its forward runs over all of
them, ours over t_seq inputs with the last token as the final target).

The sides, each in its own process, one after another (--sides picks them):

- ours: `dpo` (reference=in_step: the base's forward in each step's graph, adapters left out), at
  --precision (bf16 on cuda: bf16 products over the quantized base, f32 adapters and AdamW); ours-recompute adds
  recompute_blocks=true; ours-precomputed is reference=precomputed (its one-off pass untimed);
  ours-chunked is logits_chunk=--logits-chunk (the output head's logits made a piece of positions at
  a time, recomputed in the backward); ours-lean is both recompute_blocks and logits_chunk.
- trl: TRL's DPOTrainer, loss_type sigmoid, on transformers' model of the base dequantized to bf16
  (toyharness's hf_model), PEFT LoRA of the same rank, alpha and targets; its reference as TRL makes
  it for a PEFT model (the same model with the adapters disabled, in each step); DPOConfig's
  defaults otherwise, gradient checkpointing on; trl-no-gc turns gradient checkpointing off.

Loss 0 (the first step's loss, log 2 on both sides: the policy is its reference there) checks
that both compute the same thing. ms/step: the median over --steps steps after --warmup (a step
waited for: our loss read back, torch.cuda.synchronize for TRL). Peak memory: the driver's count
for the process (NVML, as `toyharness bench` measures it: toyharness/device_memory.py), the largest
sampled after each step; on cpu the process's peak RSS instead.

Offline machines: torch, transformers and peft must be installed; trl (and what it needs that is
missing) can come as wheels in --trl-wheels DIR (installed from there with pip, no index). Where
trl cannot be imported, its rows say why and ours still run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA_32_1B = dict(arch="llama", n_layer=16, d_model=2048, n_head=32, n_kv_head=8, d_ff=8192, vocab=128256,
                   rope_base=500000.0, rope_factors=True)
HF_TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
              "down": "down_proj"}
SIDES = ("ours", "ours-recompute", "ours-precomputed", "ours-chunked", "ours-lean", "trl", "trl-no-gc")


# --- set-up (the parent) --------------------------------------------------------------------------
def make_base(shape: dict, dtype: str) -> Path:
    sys.path.insert(0, str(Path(__file__).parent))
    from arch_bench import seeded_base

    return seeded_base(shape, dtype)


def write_pairs(path: Path, n: int, t_seq: int) -> None:
    """n pairs of ASCII text, the prompt about half of t_seq bytes and each completion longer than
    the rest: every side runs past t_seq + 1 tokens (bytes)."""
    import random

    rng = random.Random(0)
    words = "alpha beta gamma delta river stone cloud maple ember quartz lantern orbit meadow cinder".split()

    def text(n_bytes: int) -> str:
        out = ""
        while len(out) < n_bytes:
            out += rng.choice(words) + " "
        return out[:n_bytes]

    with path.open("w") as f:
        for _ in range(n):
            f.write(json.dumps({"prompt": text(t_seq // 2), "chosen": " " + text(t_seq), "rejected": " " + text(t_seq)})
                    + "\n")


def our_sets(a, base: Path, data: Path) -> list[str]:
    return [f"base={base}", f"data={data}", f"t_seq={a.t_seq}", f"t_batch={a.t_batch}", f"rank={a.rank}",
            f"alpha={2 * a.rank}", f"targets={a.targets}", f"precision={a.precision}", f"beta={a.beta}"]


# --- the sides (each its own process) ---------------------------------------------------------------
def peak_memory_mb(backend: str) -> float | None:
    if backend == "cuda":
        from toyharness.device_memory import process_device_mb

        return process_device_mb()
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024      # Linux: KiB


def side_ours(a, base: Path, data: Path, variant: str) -> dict:
    import numpy as np

    from toyharness.bench.config import realize_for_bench

    chunk = f"logits_chunk={a.logits_chunk}"
    extra = {"ours": [], "ours-recompute": ["recompute_blocks=true"], "ours-precomputed": ["reference=precomputed"],
             "ours-chunked": [chunk], "ours-lean": ["recompute_blocks=true", chunk]}[variant]
    pm, opts, pairs, engine, model = realize_for_bench("dpo", a.backend, a.threads, our_sets(a, base, data) + extra)
    batch = pairs.rows(np.arange(a.t_batch))
    if variant == "ours-precomputed":
        model.precompute_reference()          # the one-off pass, not timed
    times, peak, losses = [], 0.0, []
    for i in range(a.warmup + a.steps):
        row = pm.hook.hp(options=opts, step=i)
        t0 = time.perf_counter()
        out = pm.hook.step(model=model, batch=batch, hp=row)      # the loss read back: the step is done
        ms = (time.perf_counter() - t0) * 1e3
        losses.append(float(out["loss"] if isinstance(out, dict) else out))
        if i >= a.warmup:
            times.append(ms)
        peak = max(peak, peak_memory_mb(a.backend) or 0.0)
    parts = {"compute_buffers_mb": model.prog.compute_buffer_bytes() / 2**20,
             "persistent_mb": model.prog.persistent_bytes() / 2**20}
    if a.backend == "cuda" and opts.precision == "bf16":      # native/cuda/th-precision.cu's memory
        from toyharness._ffi import lib

        parts.update(bf16_copies_mb=lib.th_cuda_bf16_copy_bytes() / 2**20,
                     bf16_scratch_mb=lib.th_cuda_bf16_scratch_bytes() / 2**20)
    return {"ms": statistics.median(times), "peak_mb": peak or None, "first_loss": losses[0],
            "parts": {k: round(v) for k, v in parts.items()},
            "note": f"{opts.precision}, reference={opts.reference}, recompute_blocks={opts.recompute_blocks}, "
                    f"logits_chunk={opts.logits_chunk}"}


def import_trl(wheels: str | None):
    """trl, installed from `wheels` (no index) where it is missing and a folder is given."""
    try:
        import trl
        return trl
    except ImportError as exc:
        if not wheels:
            raise ImportError(f"trl is not installed ({exc}); pass --trl-wheels DIR with a trl wheel "
                              "(and any of its dependencies that are missing)") from None
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", wheels,
                          "trl"], capture_output=True, text=True)
    if res.returncode:
        raise ImportError(f"pip could not install trl from {wheels}: {res.stderr.strip().splitlines()[-1:]}")
    try:
        import trl
    except ImportError as exc:
        raise ImportError(f"trl installed from {wheels} but does not import: {exc}") from None
    return trl


def trl_pairs(pairs, n: int) -> list[dict]:
    """Our loader's token ids as TRL's tokenized columns: prompt_ids, chosen_ids, rejected_ids (each
    row's t_seq inputs and its last target: the t_seq + 1 ids a row reads)."""
    import numpy as np

    out = []
    for i in range(n):
        sides = []
        for j in range(2):
            ids = np.append(pairs.tokens[i, j], pairs.targets[i, j, -1]).tolist()
            start = int(np.argmax(pairs.completion[i, j] > 0)) + 1     # target t is ids[t + 1]
            sides.append((ids[:start], ids[start:]))
        if sides[0][0] != sides[1][0]:
            raise RuntimeError(f"pair {i}: the two sides' prompts differ")
        out.append({"prompt_ids": sides[0][0], "chosen_ids": sides[0][1], "rejected_ids": sides[1][1]})
    return out


def byte_tokenizer(vocab: int):
    """A transformers tokenizer over the harness's byte ids, for what DPOTrainer asks of one (its pad
    token): the data reaches TRL already tokenized."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    table = {f"<{i}>": i for i in range(vocab)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(table, unk_token="<0>")))
    tok.pad_token = tok.eos_token = "<0>"
    return tok


def step_timer_class(device: str, times: list):
    """A transformers TrainerCallback class that appends each step's ms to `times`, the device
    synchronized at both ends (cuda)."""
    import torch
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if device == "cuda":
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if device == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - self.t0) * 1e3)

    return Timer


def side_trl(a, base: Path, data: Path, variant: str) -> dict:
    trl = import_trl(a.trl_wheels)
    import datasets
    import torch
    from peft import LoraConfig

    from toyharness import hf_model
    from toyharness.bench.config import bench_options
    from toyharness.hookspecs import plugin_manager
    from toyharness.runner import load_data

    device = "cuda" if a.backend == "cuda" else "cpu"
    bf16 = a.precision == "bf16"
    obj, opts = bench_options("dpo", our_sets(a, base, data))
    pairs = load_data(plugin_manager(obj), opts)       # our loader: the ids our side steps on
    rows = trl_pairs(pairs, a.t_batch)
    # the same t_batch pairs every step: the dataset repeats them, unshuffled
    dataset = datasets.Dataset.from_list(rows * (a.warmup + a.steps))
    model = hf_model(base, attention="sdpa").to(dtype=torch.bfloat16 if bf16 else torch.float32, device=device)

    class Trainer(trl.DPOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset        # already TRL's tokenized columns (ours)

        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

    times, peak, losses = [], [0.0], []

    class Timer(step_timer_class(device, times)):
        def on_step_end(self, args, state, control, **kw):
            super().on_step_end(args, state, control, **kw)
            peak[0] = max(peak[0], peak_memory_mb(a.backend) or 0.0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    gc = variant == "trl"
    with tempfile.TemporaryDirectory() as tmp:
        cfg = trl.DPOConfig(output_dir=tmp, per_device_train_batch_size=a.t_batch, max_steps=a.warmup + a.steps,
                            max_length=a.t_seq + 1, beta=a.beta, loss_type=["sigmoid"], learning_rate=1e-4,
                            gradient_checkpointing=gc, bf16=bf16, use_cpu=device == "cpu", report_to="none",
                            save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
                            remove_unused_columns=False, seed=0)
        peft_cfg = LoraConfig(r=a.rank, lora_alpha=2 * a.rank, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                              target_modules=[HF_TARGETS[t] for t in a.targets.split(",")])
        trainer = Trainer(model=model, args=cfg, train_dataset=dataset, processing_class=byte_tokenizer(pairs.vocab),
                          peft_config=peft_cfg, callbacks=[Timer()])
        if trainer.ref_model is not None:
            raise RuntimeError("TRL made a separate reference model; the race expects PEFT's adapters-off reference")
        trainer.train()
    return {"ms": statistics.median(times[a.warmup:]), "peak_mb": peak[0] or None,
            "first_loss": losses[0] if losses else None,
            "note": f"trl {trl.__version__}, {'bf16' if bf16 else 'fp32'}, gradient_checkpointing={gc}, "
                    "reference: adapters disabled"}


# --- the parent: set-up, the sides, the table ---------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cuda", choices=("cpu", "cuda"))
    ap.add_argument("--precision", default=None, choices=("fp32", "bf16"), help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--t-seq", type=int, default=1024)
    ap.add_argument("--t-batch", type=int, default=2, help="pairs per step (2 x rows of t_seq)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default="q,v")
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--type", default="q4_k", help="the base's matrix type (default q4_k)")
    ap.add_argument("--vocab", type=int, default=LLAMA_32_1B["vocab"])
    ap.add_argument("--shape", default=None,
                    help="JSON over Llama-3.2-1B's shape, e.g. '{\"n_layer\": 2, \"d_model\": 256}' (a cpu check)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--sides", default="ours,ours-lean,trl,trl-no-gc")
    ap.add_argument("--logits-chunk", type=int, default=1024, help="ours-chunked and ours-lean: positions of "
                    "the output head a piece (the option logits_chunk)")
    ap.add_argument("--trl-wheels", default=None, help="a folder of wheels: trl, and its missing dependencies")
    ap.add_argument("--side", default=None, help=argparse.SUPPRESS)      # a child process's one side
    ap.add_argument("--base", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.precision = a.precision or ("bf16" if a.backend == "cuda" else "fp32")
    if a.side:
        fn = side_trl if a.side.startswith("trl") else side_ours
        print("RESULT " + json.dumps(fn(a, Path(a.base), Path(a.data), a.side)), flush=True)
        return 0
    sides = a.sides.split(",")
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        sys.exit(f"--sides: unknown {', '.join(unknown)}; known: {', '.join(SIDES)}")
    bad = [t for t in a.targets.split(",") if t not in HF_TARGETS]
    if bad:
        sys.exit(f"--targets: unknown {', '.join(bad)}; known: {', '.join(HF_TARGETS)}")
    shape = {**LLAMA_32_1B, "vocab": a.vocab, **json.loads(a.shape or "{}")}
    t0 = time.perf_counter()
    base = make_base(shape, a.type)
    print(f"base {base} ({a.type}, {time.perf_counter() - t0:.0f} s): {json.dumps(shape)}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "pairs.jsonl"
        write_pairs(data, max(a.t_batch, 2) + 1, a.t_seq)      # + a held-out pair, which the loader wants
        for side in sides:
            args = [sys.executable, __file__, "--side", side, "--base", str(base), "--data", str(data)]
            for key in ("backend", "precision", "steps", "warmup", "t_seq", "t_batch", "rank", "targets", "beta",
                        "threads", "trl_wheels", "logits_chunk"):
                value = getattr(a, key)
                if value is not None:
                    args += [f"--{key.replace('_', '-')}", str(value)]
            t1 = time.perf_counter()
            res = subprocess.run(args, capture_output=True, text=True)
            lines = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
            if res.returncode or not lines:
                tail = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
                results[side] = {"error": tail}
                print(f"{side}: failed ({time.perf_counter() - t1:.0f} s): {tail}", flush=True)
            else:
                results[side] = json.loads(lines[-1][len("RESULT "):])
                print(f"{side}: {results[side]} ({time.perf_counter() - t1:.0f} s)", flush=True)
    memory = "peak GPU MiB (NVML, per process)" if a.backend == "cuda" else "peak RSS MiB"
    named = "Llama-3.2-1B-shaped" if shape == LLAMA_32_1B else "llama-family"
    print(f"\nDPO step, {named} base ({a.type}, vocab {shape['vocab']}, {shape['n_layer']} layers, "
          f"d_model {shape['d_model']}), {a.t_batch} pairs x 2 sides x t_seq {a.t_seq}, LoRA rank {a.rank} on "
          f"{a.targets}, {a.backend} {a.precision}; median of {a.steps} steps after {a.warmup}")
    print(f"{'side':18} {'ms/step':>9} {memory:>33} {'loss 0':>8}  notes")
    for side in sides:
        r = results[side]
        if "error" in r:
            print(f"{side:18} {'-':>9} {'-':>33} {'-':>8}  not run: {r['error']}")
        else:
            mem = f"{r['peak_mb']:.0f}" if r["peak_mb"] else "-"
            loss = f"{r['first_loss']:.4f}" if r.get("first_loss") is not None else "-"
            print(f"{side:18} {r['ms']:9.1f} {mem:>33} {loss:>8}  {r['note']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
