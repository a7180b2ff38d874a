"""ms per training step, GFLOP/s and host overhead of a ~3M-parameter Llama block stack
(d_model 256, 4 layers, 8 heads, d_ff 640, seq 128, batch 8) on the engine.

    python scripts/engine_step.py [--threads 2] [--steps 20]

Host overhead = the whole Trainer.step (feed validation and upload, the AdamW row, the
gradient reset, reading the loss back) minus the ggml graph compute alone, timed alternately.
"""

import argparse
import json
import time

import numpy as np

from toyharness.data import load_text_data
from toyharness.engine import get_engine
from toyharness.plugins import get_recipe
from toyharness.runner import resolve_options

ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--steps", type=int, default=20)
args = ap.parse_args()

_, llama = get_recipe("llama")
sets = ["d_model=256", "n_layer=4", "n_head=8", "n_kv_head=8", "d_ff=640", "t_seq=128", "t_batch=8"]
o = resolve_options(llama, None, sets, {})
data = load_text_data()
model = llama.realize(get_engine("cpu", args.threads), o, data)
tr = model.trainer
n_params = sum(int(np.prod(p.shape)) for p in tr.prog.params.values())
tokens = o.t_batch * o.t_seq
d, L, T = o.d_model, o.n_layer, o.t_seq
matmul_params = n_params - sum(int(np.prod(p.shape)) for n, p in tr.prog.params.items() if "norm" in n) \
    - 256 * d  # the embedding lookup is not a matmul; the tied output is counted below
flops_fwd = 2 * tokens * (matmul_params - 256 * d) + 2 * tokens * 256 * d + L * 2 * 2 * o.t_batch * T * T * d
flops_step = 3 * flops_fwd

row = o.adamw_row()
step_ms, compute_ms = [], []
for i in range(3 + args.steps):
    x, y = data.batch("train", i, o.t_batch, o.t_seq, o.seed)
    t0 = time.perf_counter()
    tr.step({"tokens": x, "targets": y}, row.hp_for_step(i))
    t1 = time.perf_counter()
    tr.reset_grads()
    t2 = time.perf_counter()
    tr.prog._compute(tr.gb_opt)          # compute alone: same graph, inputs already there
    t3 = time.perf_counter()
    if i >= 3:
        step_ms.append((t1 - t0) * 1e3)
        compute_ms.append((t3 - t2) * 1e3)
step, comp = float(np.median(step_ms)), float(np.median(compute_ms))
out = {"params": n_params, "threads": args.threads, "ms_per_step": round(step, 2), "compute_ms": round(comp, 2),
       "host_overhead_pct": round(100 * (step - comp) / step, 2), "gflop_per_step": round(flops_step / 1e9, 3),
       "gflops": round(flops_step / (step / 1e3) / 1e9, 1)}
print(json.dumps(out))
