"""Issue 32's LoRA bench base: Llama-3.2-1B's body (16 layers, d_model 2048, 32 query and 8 key
heads, d_ff 8192, Llama 3's rope scaling) with the issue's vocabulary of 32000 (the real model has
128256: a smaller output layer, as the issue measured), seeded weights (std 0.02) quantized to
`dtype` by ggml's own quantizer, written once to the cache as scripts/arch_bench.py's bases are.
Prints the file's path.

    python scripts/lora_bench_base.py [--type q4_k]
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
