"""Packed against unpacked rows, side by side in one call: LoRA over a SmolLM2-135M-shaped base
(seeded, quantized to Q4_1 by ggml's quantizer, kept in the cache) on the documented synthetic
instruction set (toyharness/data/instructions.py), `toyharness run lora` with pack=true then
pack=false; with --sides ...,trl also TRL's SFTTrainer with packing (best-fit decreasing, padding-
free batches: one flattened row a step, the examples kept apart by their position ids) on the same
examples, our loader's token ids and counted positions, over transformers' model of the base
dequantized (toyharness's hf_model), PEFT LoRA of the same rank, alpha and targets.
Prints each side's median counted tokens a second (the positions the loss counts, over the step's
time; the first `--warmup` steps left out), its padding share, its peak memory (on cuda the
driver's count for the process, NVML, sampled every 20 ms from this parent) and the ratios, and
writes them with the machine's fingerprint to --json.

    python tools/packed_race.py [--backend cuda --precision bf16] [--t-seq 1024] [--t-batch 4]
        [--steps 8] [--warmup 2] [--n 2000] [--base PATH] [--data PATH] [--json OUT.json]
        [--sides packed,unpacked,trl] [--trl-wheels DIR] [--trl-attention sdpa]
        [--ours-set recompute_blocks=true --ours-set logits_chunk=256]

--base and --data take a real GGUF and a real instruction set instead (then the tokenizer is the
base's own).
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

# SmolLM2-135M's body and vocabulary (its GGUF's metadata)
SMOLLM2_135M = dict(arch="llama", n_layer=30, d_model=576, n_head=9, n_kv_head=3, d_ff=1536, vocab=49152,
                    rope_base=100000.0)


RANK, TARGETS = 8, ("q_proj", "v_proj")


def lora_sets(args, base: Path, data: Path, pack: bool) -> list[str]:
    return [f"base={base}", f"data={data}", f"t_seq={args.t_seq}", f"t_batch={args.t_batch}",
            f"pack={str(pack).lower()}", "targets=q,v", f"rank={RANK}", f"alpha={2 * RANK}",
            f"eval_every={10 * args.steps}"]


def watched(cmd: list[str], backend: str) -> tuple[str, float | None]:
    """Run `cmd`; its stdout and (cuda) its peak device memory, sampled every 20 ms."""
    from toyharness.device_memory import process_device_mb

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = None
    while proc.poll() is None and backend == "cuda":
        mb = process_device_mb(proc.pid)
        peak = mb if peak is None or (mb is not None and mb > peak) else peak
        time.sleep(0.02)
    out, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"{cmd[3:5]} failed: {(err.strip().splitlines() or ['(no output)'])[-1]}")
    return out, peak


def side_ours(args, base: Path, data: Path, pack: bool, out: Path) -> dict:
    cli = "import sys; from toyharness.cli import main; sys.exit(main())"
    cmd = [sys.executable, "-c", cli, "run", "lora", "--backend", args.backend, "--steps", str(args.steps),
           "--out", str(out), "--no-progress"]
    for s in lora_sets(args, base, data, pack) + args.ours_set:
        cmd += ["--set", s]
    if args.backend == "cuda":
        cmd += ["--set", f"precision={args.precision}"]
    else:
        cmd += ["--threads", str(args.threads)]
    _, peak = watched(cmd, args.backend)
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][args.warmup:]
    return {"side": "packed" if pack else "unpacked", "sets": args.ours_set,
            "counted_tokens_per_s": statistics.median(m["counted_tokens_per_s"] for m in steps),
            "ms": statistics.median(m["ms"] for m in steps),
            "padding": round(statistics.mean(m["padding"] for m in steps), 4), "peak_mb": peak}


def trl_examples(args, base: Path, data: Path) -> tuple[list[dict], int]:
    """Our loader's train examples as TRL's tokenized columns: input_ids and completion_mask (our
    counted positions: token i counts as a target), each cut to t_seq + 1 tokens as ours are."""
    from toyharness.bench.config import bench_options
    from toyharness.hookspecs import plugin_manager
    from toyharness.runner import load_data

    obj, opts = bench_options("lora", lora_sets(args, base, data, True))
    ex = load_data(plugin_manager(obj), opts)
    store, rows = ex.store, []
    for e in ex.order[: ex.bounds[ex.n_train]].tolist():
        a, b = int(store.offsets[e]), min(int(store.offsets[e + 1]), int(store.offsets[e]) + args.t_seq + 1)
        rows.append({"input_ids": store.ids[a:b].tolist(), "completion_mask": store.counts[a:b].astype(int).tolist()})
    return rows, ex.vocab


def side_trl(args, base: Path, data: Path) -> dict:
    """TRL's SFTTrainer with packing (run in a child process: `--side trl`)."""
    from dpo_race import byte_tokenizer, import_trl, step_timer_class

    trl = import_trl(args.trl_wheels)
    import datasets
    import torch
    from peft import LoraConfig

    from toyharness import hf_model

    device = "cuda" if args.backend == "cuda" else "cpu"
    bf16 = args.precision == "bf16" and device == "cuda"
    rows, vocab = trl_examples(args, base, data)
    model = hf_model(base, attention=args.trl_attention).to(dtype=torch.bfloat16 if bf16 else torch.float32,
                                                             device=device)

    class Trainer(trl.SFTTrainer):
        def _get_train_sampler(self, train_dataset=None):      # the packed rows in order: counted below
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

    times = []                                                   # ms

    with tempfile.TemporaryDirectory() as tmp:
        cfg = trl.SFTConfig(output_dir=tmp, per_device_train_batch_size=args.t_batch,
                            max_steps=args.warmup + args.steps, max_length=args.t_seq, packing=True,
                            completion_only_loss=True, learning_rate=1e-4, bf16=bf16, use_cpu=device == "cpu",
                            report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
                            dataloader_num_workers=0, seed=0)
        peft_cfg = LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                              target_modules=list(TARGETS))
        trainer = Trainer(model=model, args=cfg, train_dataset=datasets.Dataset.from_list(rows),
                          processing_class=byte_tokenizer(vocab), peft_config=peft_cfg,
                          callbacks=[step_timer_class(device, times)()])
        packed = trainer.train_dataset
        counted = [sum(int(x != -100) for x in labels) for labels in packed["labels"]]
        positions = [len(ids) for ids in packed["input_ids"]]
        trainer.train()
    b, w = args.t_batch, args.warmup
    per_step = [sum(counted[i * b:(i + 1) * b]) for i in range(len(times))]
    rates = [c / (t / 1e3) for c, t in zip(per_step[w:], times[w:])]
    held = sum(positions[w * b:len(times) * b])
    return {"side": "trl", "counted_tokens_per_s": statistics.median(rates),
            "ms": statistics.median(times[w:]),
            "padding": round(1 - held / (args.t_seq * b * (len(times) - w)), 4),
            "note": f"trl {trl.__version__}, {'bf16' if bf16 else 'fp32'}, attention {args.trl_attention}, "
                    f"packing {cfg.packing_strategy}, gradient_checkpointing={cfg.gradient_checkpointing}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--precision", default="bf16", choices=["fp32", "tf32", "bf16"], help="cuda only")
    ap.add_argument("--threads", type=int, default=2, help="cpu only")
    ap.add_argument("--t-seq", type=int, default=1024)
    ap.add_argument("--t-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--n", type=int, default=2000, help="synthetic examples")
    ap.add_argument("--base", type=Path, help="a real GGUF instead of the seeded SmolLM2-135M-shaped one")
    ap.add_argument("--data", type=Path, help="a real JSONL set instead of the synthetic one")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--sides", default="packed,unpacked", help="of packed, unpacked, trl")
    ap.add_argument("--trl-wheels", default=None, help="a folder of wheels: trl, and its missing dependencies")
    ap.add_argument("--trl-attention", default="sdpa", help="transformers' attn_implementation for TRL's side")
    ap.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE",
                    help="an option of our runs besides the race's (e.g. recompute_blocks=true, logits_chunk=256)")
    ap.add_argument("--side", default=None, help=argparse.SUPPRESS)      # a child process's one side
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    if args.side == "trl":
        print("RESULT " + json.dumps(side_trl(args, args.base, args.data)), flush=True)
        return
    sides = args.sides.split(",")
    unknown = [s for s in sides if s not in ("packed", "unpacked", "trl")]
    if unknown:
        sys.exit(f"--sides: unknown {', '.join(unknown)}; known: packed, unpacked, trl")
    from arch_bench import seeded_base

    from toyharness.data.instructions import write_synthetic_instructions
    from toyharness.engine import get_engine

    base = args.base or seeded_base(SMOLLM2_135M, "q4_1")
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data
        if data is None:
            data = Path(tmp) / "synthetic.jsonl"
            write_synthetic_instructions(data, args.n)
        rows = []
        for side in sides:
            if side == "trl":
                cmd = [sys.executable, __file__, "--side", "trl", "--base", str(base), "--data", str(data)]
                for key in ("backend", "precision", "t_seq", "t_batch", "steps", "warmup", "trl_wheels",
                            "trl_attention"):
                    if getattr(args, key) is not None:
                        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
                out, peak = watched(cmd, args.backend)
                result = [x for x in out.splitlines() if x.startswith("RESULT ")]
                rows.append({**json.loads(result[-1][len("RESULT "):]), "peak_mb": peak})
            else:
                rows.append(side_ours(args, base, data, side == "packed", Path(tmp) / f"run-{side}"))
    engine = get_engine(args.backend)
    where = f"precision {args.precision}" if args.backend == "cuda" else f"{args.threads} threads"
    print(f"LoRA q,v rank {RANK} over {base.name}, t_seq {args.t_seq} x {args.t_batch}, {args.backend} {where}, "
          f"fingerprint {engine.fingerprint()}")
    for r in rows:
        peak = f"{r['peak_mb']:8.0f} MiB peak" if r.get("peak_mb") else ""
        print(f"  {r['side']:9} {r['counted_tokens_per_s']:10.1f} counted tokens/s  {r['ms']:9.1f} ms/step  "
              f"padding {r['padding']:.1%}  {peak}  {r.get('note', '')}")
    by_side = {r["side"]: r["counted_tokens_per_s"] for r in rows}
    ratios = {f"packed/{s}": by_side["packed"] / by_side[s] for s in by_side if s != "packed" and "packed" in by_side}
    for name, value in ratios.items():
        print(f"  {name}: {value:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"fingerprint": engine.fingerprint(), "backend": args.backend, "config": where,
                                         "base": base.name, "t_seq": args.t_seq, "t_batch": args.t_batch,
                                         "rows": rows, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
