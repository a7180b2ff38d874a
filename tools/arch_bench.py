"""Speed and memory of LoRA at the bench config (t_seq 256 x 4, rank 8, 2 threads)
over a seeded base of each architecture at its smallest real size, beside PyTorch on the dequantized
base (transformers' model of the architecture: toyharness/architectures/hf.py).

    python tools/arch_bench.py OUT_DIR [ARCH...] [--type q4_k] [--steps 10]

Each base is written by `architectures.write_example` at the real model's shape (its keys and
tensors as llama.cpp's converter writes them; seeded weights, the byte vocabulary's first 256 ids
used by the data), quantized with ggml's quantizer, and kept in the cache outside the clone. For
each: `toyharness bench lora` (OUT_DIR/bench_ARCH.json) and `tools/lora_memory.py`
(OUT_DIR/memory_ARCH.json: resident memory beyond the program's own buffers, against the file).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from toyharness.architectures import ARCHITECTURES, example_shape, write_example
from toyharness.engine.gguf_io import cached_copy_as
from toyharness.lm import cache_root

# The smallest real model of each architecture (its transformers config), as example_shape arguments.
# phi3's smallest is 3.8B (Phi-3-mini): its 32 layers' f32 intermediate alone is 15 GB, so it is
# benched at its full width and vocabulary with 8 of its layers, and said so.
REAL_SIZES = {
    "llama": ("Llama-3.2-1B", dict(arch="llama", n_layer=16, d_model=2048, n_head=32, n_kv_head=8, d_ff=8192,
                                   vocab=128256, rope_base=500000.0, rope_factors=True)),
    "qwen3": ("Qwen3-0.6B", dict(arch="qwen3", n_layer=28, d_model=1024, n_head=16, n_kv_head=8, head_dim=128,
                                 d_ff=3072, vocab=151936, rope_base=1e6)),
    "gemma3": ("Gemma-3-270M", dict(arch="gemma3", n_layer=18, d_model=640, n_head=4, n_kv_head=1, head_dim=256,
                                    d_ff=2048, vocab=262144, window=512, rope_base=1e6)),
    "phi3": ("Phi-3-mini at 8 of its 32 layers", dict(arch="phi3", n_layer=8, d_model=3072, n_head=32, n_kv_head=32,
                                                        d_ff=8192, vocab=32064, window=2047, rope_base=10000.0)),
}


def real_size_base(arch: str, dtype: str) -> Path:
    return seeded_base(REAL_SIZES[arch][1], dtype)


def seeded_base(kw: dict, dtype: str) -> Path:
    """A base of `example_shape(**kw)` (seeded, std 0.02) in type `dtype`, kept in the cache."""
    arch = kw["arch"]
    key = hashlib.sha256(repr((kw, dtype)).encode()).hexdigest()[:12]
    path = cache_root() / "models" / f"{arch}-real-size-{key}.{dtype}.gguf"
    if not path.is_file():
        f32 = cache_root() / "models" / f"{arch}-real-size-{key}.f32.gguf"
        write_example(f32, example_shape(**kw), std=0.02)
        cached = cached_copy_as(f32, dtype)
        cached.rename(path)
        f32.unlink()
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("archs", nargs="*", default=list(REAL_SIZES))
    ap.add_argument("--type", default="q4_k", help="the base's matrix type (gemma3: q5_0, llama-quantize's "
                                                    "own choice for Q4_K where rows of 640 fill no 256-value block)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for arch in args.archs:
        dtype = "q5_0" if arch == "gemma3" and args.type.endswith("_k") else args.type
        base = real_size_base(arch, dtype)
        targets = "qkv" if "q" not in ARCHITECTURES[arch].targets else "q,v"
        sets = [f"base={base}", "t_seq=256", "t_batch=4", f"targets={targets}", "rank=8"]
        setargs = [x for s in sets for x in ("--set", s)]
        subprocess.run([sys.executable, "-m", "toyharness.cli", "bench", "lora", *setargs, "--threads",
                        str(args.threads), "--steps", str(args.steps), "--warmup", "2", "--out",
                        str(out / f"bench_{arch}.json")], check=True)
        mem = subprocess.run([sys.executable, str(Path(__file__).parent / "lora_memory.py"), str(base), *setargs],
                             check=True, capture_output=True, text=True).stdout
        (out / f"memory_{arch}.json").write_text(mem)
        r = json.loads((out / f"bench_{arch}.json").read_text())["recipes"]["lora"]
        m = json.loads(mem)
        rows.append((arch, REAL_SIZES[arch][0], r["ms_per_step"], r["torch_ms_per_step"], r["speedup"],
                     m.get("beyond_own_mb"), m.get("beyond_own_pct_of_file")))
        print(f"{arch} ({REAL_SIZES[arch][0]}, {dtype}): {r['ms_per_step']:.0f} ms against PyTorch's "
              f"{r['torch_ms_per_step']:.0f} ms, {r['speedup']:.2f}x; beyond own buffers "
              f"{m.get('beyond_own_mb')} MB ({m.get('beyond_own_pct_of_file')}% of the file)", flush=True)
    (out / "arch_bench.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
