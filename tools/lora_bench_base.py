"""The base of the bf16 LoRA bench (tools/gpu_precision.sh bench-lora-bf16): Llama-3.2-1B's body
(16 layers, d_model 2048, 32 query and 8 key heads, d_ff 8192, Llama 3's rope scaling) with a
vocabulary of 32000 (the real model has 128256: the bench keeps a smaller output layer), seeded
weights (std 0.02) quantized to `dtype` by ggml's own quantizer, written once to the cache as
tools/arch_bench.py's bases are.
Prints the file's path.

    python tools/lora_bench_base.py [--type q4_k]
"""

from __future__ import annotations

import argparse

from arch_bench import REAL_SIZES, seeded_base

ISSUE_32_VOCAB = 32000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--type", default="q4_k")
    args = ap.parse_args()
    print(seeded_base({**REAL_SIZES["llama"][1], "vocab": ISSUE_32_VOCAB}, args.type))


if __name__ == "__main__":
    main()
