"""Packed against unpacked rows, side by side in one call: LoRA over a SmolLM2-135M-shaped base
(seeded, quantized to Q4_1 by ggml's quantizer, kept in the cache) on the documented synthetic
instruction set (toyharness/data/instructions.py), `toyharness run lora` with pack=true then
pack=false. Prints each run's median counted tokens a second (the positions the loss counts, over
the step's time; the first `--warmup` steps left out), its padding share and the ratio, and writes
them with the machine's fingerprint to --json.

    python tools/packed_race.py [--backend cuda --precision bf16] [--t-seq 1024] [--t-batch 4]
        [--steps 8] [--warmup 2] [--n 2000] [--base PATH] [--data PATH] [--json OUT.json]

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
from pathlib import Path

# SmolLM2-135M's body and vocabulary (its GGUF's metadata)
SMOLLM2_135M = dict(arch="llama", n_layer=30, d_model=576, n_head=9, n_kv_head=3, d_ff=1536, vocab=49152,
                    rope_base=100000.0)


def run_once(args, base: Path, data: Path, pack: bool, out: Path) -> dict:
    cli = "import sys; from toyharness.cli import main; sys.exit(main())"
    cmd = [sys.executable, "-c", cli, "run", "lora", "--backend", args.backend, "--steps", str(args.steps),
           "--out", str(out), "--no-progress", "--set", f"base={base}", "--set", f"data={data}",
           "--set", f"t_seq={args.t_seq}", "--set", f"t_batch={args.t_batch}", "--set", f"pack={str(pack).lower()}",
           "--set", "targets=q,v", "--set", "rank=8", "--set", f"eval_every={10 * args.steps}"]
    if args.backend == "cuda":
        cmd += ["--set", f"precision={args.precision}"]
    else:
        cmd += ["--threads", str(args.threads)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][args.warmup:]
    return {"pack": pack, "counted_tokens_per_s": statistics.median(m["counted_tokens_per_s"] for m in steps),
            "ms": statistics.median(m["ms"] for m in steps),
            "padding": round(statistics.mean(m["padding"] for m in steps), 4)}


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
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from arch_bench import seeded_base

    from toyharness.data.instructions import write_synthetic_instructions
    from toyharness.engine import get_engine

    base = args.base or seeded_base(SMOLLM2_135M, "q4_1")
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data
        if data is None:
            data = Path(tmp) / "synthetic.jsonl"
            write_synthetic_instructions(data, args.n)
        rows = [run_once(args, base, data, pack, Path(tmp) / f"run-{pack}") for pack in (True, False)]
    engine = get_engine(args.backend)
    where = f"precision {args.precision}" if args.backend == "cuda" else f"{args.threads} threads"
    ratio = rows[0]["counted_tokens_per_s"] / rows[1]["counted_tokens_per_s"]
    print(f"LoRA q,v rank 8 over {base.name}, t_seq {args.t_seq} x {args.t_batch}, {args.backend} {where}, "
          f"fingerprint {engine.fingerprint()}")
    for r in rows:
        print(f"  pack={str(r['pack']).lower():5}  {r['counted_tokens_per_s']:10.1f} counted tokens/s  "
              f"{r['ms']:9.1f} ms/step  padding {r['padding']:.1%}")
    print(f"  packed / unpacked: {ratio:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"fingerprint": engine.fingerprint(), "backend": args.backend, "config": where,
                                         "base": base.name, "t_seq": args.t_seq, "t_batch": args.t_batch,
                                         "rows": rows, "ratio": ratio}, indent=1))


if __name__ == "__main__":
    main()
