"""`toyharness bench`: training steps of each recipe beside an equivalent PyTorch eager model.

Each side runs in its own worker process (so each has its own peak RSS, and one side's
threads never share a process with the other's). The parent drives them in alternating rounds,
toyharness then PyTorch, then PyTorch then toyharness, so drift of the machine (clock, other
load) falls on both sides alike. Both train the same model from the same initial weights on the
same batches: the recipe's bench config (its defaults, plus a recipe's ``bench_sets``, e.g.
lora's seeded base), and the PyTorch side is toyharness/reference.py's model of the recipe with
torch.optim.AdamW (the fastest of its eager implementations available) at the same thread count.

Figures per recipe: median ms/step over the timed steps, items/s (tokens, or images for
vit_tiny), peak RSS of each worker, the step's matrix-product GFLOP/s (counted from the ggml
graph: MUL_MAT and OUT_PROD) against the FP32 matmul ceiling measured once with a 2048^3
sgemm at the same thread count, and the host overhead: each timed step minus its ggml graph
compute (timed inside the step), median over the steps, as a share of the median step.
bench.json also keeps each round's median per side; where a side's rounds differ by more than
DRIFT, the machine's speed moved during the recipe (a shared VM's slow minutes) and `bench`
says so: such a run's ratio is worth checking against others. On cpu it also keeps the round
trip of a cache line between the first two CPUs before and after the recipe's rounds
(cpu_round_trip_ns): on the 2-core VM it rises from about 90 to about 400 ns in the minutes
when the host puts the two CPUs far apart, and threads that share data slow down then.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .device_memory import PeakDeviceMemory

N_BATCHES = 8          # distinct batches cycled through (same ones on both sides)
# Pause before each block of steps: OpenMP threads of the side that just ran spin-wait for a
# while after their last parallel region; on 2 cores they would steal the other side's time.
SETTLE_S = 0.3
# Round medians of one side further apart than this, and `bench` says the machine's speed moved.
DRIFT = 0.2
# Named model sizes (`bench --size`), laid over a recipe's bench config before its --set: the
# sizes people train small models at (issue 21's table). nano: nanoGPT's shakespeare-char model
# (on a 2-core cpu, add --set t_batch=8); gpt2-small: GPT-2 small's body, on our byte vocabulary.
SIZES: dict[str, tuple[str, ...]] = {
    "default": (),
    "nano": ("n_layer=6", "d_model=384", "n_head=6", "t_seq=256", "t_batch=64"),
    "gpt2-small": ("n_layer=12", "d_model=768", "n_head=12", "t_seq=1024", "t_batch=8"),
}


# PyTorch's side at each precision (`bench --precision`, issue 32): the modes its workers run, the
# first the one `speedup` compares with. tf32: TF32 matrix products, eager; bf16: bf16 autocast,
# with torch.compile (nanoGPT's defaults) and eager, both reported.
TORCH_MODES: dict[str, tuple[str, ...]] = {"fp32": ("eager",), "tf32": ("eager",), "bf16": ("compile", "eager")}


def torch_precision_setup(torch, precision: str):
    """Set PyTorch up for `precision`; returns the context each forward runs in (autocast for bf16)."""
    import contextlib

    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    if precision == "bf16":
        return lambda dev: torch.autocast(dev.type, dtype=torch.bfloat16)
    return lambda dev: contextlib.nullcontext()


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def reference_config(options, with_frozen: bool = True) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The PyTorch reference's view of a run's options: the config dict its model functions read
    (for lora, the base's sizes) and the frozen arrays (for lora, the base's tensors, dequantized
    to f32: `base_arrays`; none without `with_frozen`)."""
    from .engine import GGUFFile

    cfg = options.to_dict()
    frozen: dict[str, np.ndarray] = {}
    if cfg.get("base"):
        frozen = base_arrays(cfg["base"]) if with_frozen else {}
        with GGUFFile(cfg["base"]) as f:
            arch = f.field("general.architecture")
            cfg.update(n_layer=f.field(f"{arch}.block_count"), n_head=f.field(f"{arch}.attention.head_count"),
                       n_kv_head=f.field(f"{arch}.attention.head_count_kv"),
                       rope_base=f.field(f"{arch}.rope.freq_base", 10000.0),
                       rms_eps=f.field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5))
    return cfg, frozen


def transformers_side(base: str | None) -> bool:
    """Whether PyTorch's side of a run over `base` is transformers' model of it
    (toyharness/architectures/hf.py): every base but a `llama` one without rope scaling, whose
    PyTorch model is toyharness/reference.py's llama."""
    from .architectures import read_model

    if not base:
        return False
    s = read_model(base).shape
    return not (s.arch == "llama" and s.rope_factors is None and all(lay.rope_scale == 1.0 for lay in s.layers))


def base_arrays(path: str) -> dict[str, np.ndarray]:
    """Every tensor of a base GGUF as f32 numpy, dequantized by gguf-py (engine/quant.py): the
    PyTorch side's frozen weights."""
    from .engine import GGUFFile

    with GGUFFile(path) as f:
        return {n: f.tensor(n).to_numpy() for n in f.names}


def bench_options(recipe: str, sets: list[str] | None = None):
    from .plugins import get_recipe
    from .runner import resolve_options

    _, obj = get_recipe(recipe)
    return obj, resolve_options(obj, None, list(getattr(obj, "bench_sets", [])) + list(sets or []), {})


def fits_size(recipe: str, size: str) -> bool:
    """Whether `recipe`'s options have every option the size preset sets."""
    _, opts = bench_options(recipe)
    return all(hasattr(opts, kv.split("=", 1)[0]) for kv in SIZES[size])


def size_sets(recipe: str, size: str, sets: list[str] | None = None) -> list[str]:
    """The --set list for `recipe` at the named size: the preset's, then `sets` (which win)."""
    from .errors import InputError

    if size not in SIZES:
        raise InputError(f"--size {size}: unknown size; known: {', '.join(SIZES)}")
    if not fits_size(recipe, size):
        _, opts = bench_options(recipe)
        missing = [kv.split("=", 1)[0] for kv in SIZES[size] if not hasattr(opts, kv.split("=", 1)[0])]
        raise InputError(f"--size {size}: recipe {recipe} has no option {', '.join(missing)}")
    return list(SIZES[size]) + list(sets or [])


def realize_for_bench(recipe: str, backend: str, threads: int, sets: list[str] | None):
    """The recipe's model at its bench config: (plugin manager, options, data, engine, model)."""
    from .engine import get_engine
    from .hookspecs import plugin_manager
    from .runner import load_data

    obj, opts = bench_options(recipe, sets)
    pm = plugin_manager(obj)
    data = load_data(pm, opts)
    engine = get_engine(backend, threads)
    engine.set_portable(opts.portable)
    engine.set_precision(opts.precision)
    return pm, opts, data, engine, pm.hook.realize(engine=engine, options=opts, data=data)


def step_timer(pm, opts, model, batches: list) -> Callable[[], float]:
    """A function that runs the next training step, cycling through `batches`, and returns its
    ms (the AdamW row is made outside the timing)."""
    done = 0

    def timed_step() -> float:
        nonlocal done
        row = pm.hook.hp(options=opts, step=done)
        t0 = time.perf_counter()
        pm.hook.step(model=model, batch=batches[done % len(batches)], hp=row)
        done += 1
        return (time.perf_counter() - t0) * 1e3

    return timed_step


def cpu_round_trip_ns() -> float | None:
    """ns for a cache line's round trip between the first two CPUs this process may use
    (native/shim.c, th_cpu_round_trip_ns); None with one CPU, or where threads cannot be pinned."""
    from ._ffi import lib

    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return None
    if len(cpus) < 2:
        return None
    ns = lib.th_cpu_round_trip_ns(cpus[0], cpus[1], 20000)
    return round(ns, 1) if ns > 0 else None


# --- the toyharness side --------------------------------------------------------------------------
def _ggml_worker(conn, recipe: str, backend: str, threads: int, sets: list[str]) -> None:
    from ._ffi import lib
    from .runner import batch_for, items_per_batch

    pm, opts, data, engine, model = realize_for_bench(recipe, backend, threads, sets)
    trainer = getattr(model, "trainer", None)
    batches = [batch_for(data, "train", i, opts) for i in range(N_BATCHES)]
    if trainer is not None:      # trainable only: a frozen base reaches PyTorch by its path (below)
        params = {n: trainer.prog.read(t) for n, t in trainer.prog.params.items()}
    else:
        params = model.params() if hasattr(model, "params") else {}
    # The frozen base reaches PyTorch by its path (the worker dequantizes it): an f32 copy made
    # here would count in this side's peak RSS, which must show the base staying a mapped file.
    cfg, _ = reference_config(opts, with_frozen=False)
    conn.send({"items": items_per_batch(data, opts), "batches": batches, "params": params,
               "cfg": cfg, "fingerprint": engine.fingerprint(), "options": opts.to_dict()})
    step = step_timer(pm, opts, model, batches)
    device = PeakDeviceMemory() if backend == "cuda" else None

    def timed_step() -> tuple[float, float | None]:
        """One step's ms, and the ms of it spent outside the ggml graph compute (None without a
        ggml trainer)."""
        ms = step()
        return ms, (ms - trainer.prog.last_compute_s * 1e3 if trainer is not None else None)

    while True:
        cmd, n = conn.recv()
        if cmd == "steps":
            times = [timed_step() for _ in range(n)]
            if device is not None:
                device.sample()
            conn.send(times)
        else:
            # Counted after the steps: the first compute swaps in the cpu kernels, and the
            # centring products then no longer multiply.
            flops = None
            if trainer is not None:
                g = trainer.gb_opt
                nodes = (lib.ggml_graph_node(g, i) for i in range(lib.ggml_graph_n_nodes(g)))
                flops = sum(lib.th_node_matmul_flops(node) for node in nodes)
            done = {"peak_rss_mb": _peak_rss_mb(), "flops": flops}
            if device is not None:
                done["device_mb"] = device.peak_mb
                if opts.precision == "bf16":     # of which the bf16 copies' memory (th-precision.cu)
                    done["bf16_copies_mb"] = lib.th_cuda_bf16_copy_bytes() / 2**20
                    done["bf16_copies_peak_mb"] = lib.th_cuda_bf16_copy_peak_bytes() / 2**20
            conn.send(done)
            return


# --- where the time goes ---------------------------------------------------------------------
@dataclass
class OpTime:
    op: str            # the ggml op as the graph was built ("[heads]": a product per attention head)
    kernel: str        # "ggml", the native/cpu_kernels.c kernel's name (th_kernel_name), or "fused away"
    nodes: int
    ms: float


@dataclass
class NodeTime:
    index: int         # the node's place in the training graph
    op: str
    shape: tuple[int, ...]   # the node's ne (ggml order, trailing 1s dropped)
    ms: float


@dataclass
class Profile:
    total_ms: float    # the sum of the node medians
    ops: list[OpTime]  # largest first
    slowest: list[NodeTime]
    floor_us: float | None   # median time of a node that computes nothing (a view): the per-node
                             # cost of launching and waiting, already inside each node's time
    step_ms: float     # a whole step's median (3 steps before the nodes are timed)
    phases: dict[str, float]   # ms per phase: forward, backward, adamw


# Ops that no backend computes (views of another node's memory): their time is the floor.
_NO_COMPUTE = {"NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"}


def _shape(node) -> tuple[int, ...]:
    from ._ffi import ffi, lib

    ne, nb = ffi.new("int64_t[4]"), ffi.new("size_t[4]")
    lib.th_tensor_shape(node, ne, nb)
    dims = list(ne)
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return tuple(int(d) for d in dims)


def _key(node) -> int:
    from ._ffi import ffi

    return int(ffi.cast("uintptr_t", node))


def _op_label(node, op: str) -> str:
    """The op, with "[heads]" on a product batched over heads (attention's scores and its product
    with V, and their gradients) to set it apart from a weight's product or gradient."""
    from ._ffi import ffi, lib

    if op == "MUL_MAT":
        weight_side = lib.th_tensor_src(node, 0)
        if weight_side == ffi.NULL:      # a product the cuda rewrite fused away (attention's scores)
            return op + "[heads]"
    elif op == "OUT_PROD":
        weight_side = node
    else:
        return op
    return op + "[heads]" if len(_shape(weight_side)) > 2 else op


def profile_recipe(recipe: str, backend: str = "cpu", threads: int = 2, sets: list[str] | None = None,
                   repeats: int = 5, n_slowest: int = 10) -> Profile:
    """Time one training step node by node (`toyharness bench --profile`): the step's graph
    computed one node at a time, `repeats` times, after 6 whole steps (the last 3 timed), each node waited
    for before the next starts. The sum of the node medians is above a whole step's time by one
    hand-off per node (cpu: the threads'; cuda: a launch and a wait, with no CUDA graph:
    profiling turns them off, as a graph per one-node view would only add its capture). The
    profile splits the time per op, and per phase: the forward graph's nodes, AdamW's, and the
    rest (the backward)."""
    if backend == "cuda":
        os.environ["GGML_CUDA_DISABLE_GRAPHS"] = "1"   # read once, at the first cuda compute
    from ._ffi import ffi, lib
    from .errors import InputError
    from .runner import batch_for

    pm, opts, data, engine, model = realize_for_bench(recipe, backend, threads, sets)
    trainer = getattr(model, "trainer", None)
    if trainer is None:
        raise InputError(f"recipe {recipe}: no ggml training graph to profile")
    graph = trainer.gb_opt
    n = lib.ggml_graph_n_nodes(graph)
    # each node's op as built, by node (a rewrite may move nodes: cuda's attention copies)
    built = {_key(lib.ggml_graph_node(graph, i)): ffi.string(lib.ggml_op_desc(lib.ggml_graph_node(graph, i))).decode()
             for i in range(n)}
    step_ms = []
    for step in range(6):             # the first compute also swaps in our cpu kernels
        t0 = time.perf_counter()
        pm.hook.step(model=model, batch=batch_for(data, "train", step, opts), hp=pm.hook.hp(options=opts, step=step))
        step_ms.append((time.perf_counter() - t0) * 1e3)
    runs = np.empty((repeats, n))
    us = ffi.new("double[]", n)
    for r in range(repeats):
        trainer.reset_grads()
        status = lib.th_graph_profile(engine.handle, graph, us)
        if status != 0:
            raise RuntimeError(f"ggml graph compute failed with status {status}")
        runs[r] = np.frombuffer(ffi.buffer(us, n * 8), dtype=np.float64)
    per_node = np.median(runs, axis=0) / 1e3
    table: dict[tuple[str, str], OpTime] = {}
    n_forward = lib.ggml_graph_n_nodes(trainer.gf)     # gb_opt begins with the forward graph's nodes
    phases = {"forward": 0.0, "backward": 0.0, "adamw": 0.0}
    nodes: list[NodeTime] = []
    idle = []
    for i in range(n):
        node = lib.ggml_graph_node(graph, i)
        op = built[_key(node)]
        phase = "forward" if i < n_forward else "adamw" if op == "OPT_STEP_ADAMW" else "backward"
        phases[phase] += float(per_node[i])
        now = ffi.string(lib.ggml_op_desc(node)).decode()
        name = lib.th_kernel_name(node)
        if name == ffi.NULL:
            name = lib.th_portable_kernel_name(node)
        if name == ffi.NULL and trainer.prog.cuda_kernels:
            name = lib.th_cuda_kernel_name(node)
        kernel = ffi.string(name).decode() if name != ffi.NULL else "ggml"
        if now == "NONE" and op != "NONE":      # folded into another node's kernel
            kernel = "fused away"
        if now in _NO_COMPUTE:
            idle.append(per_node[i])
        label = _op_label(node, op)
        row = table.setdefault((label, kernel), OpTime(label, kernel, 0, 0.0))
        row.nodes += 1
        row.ms += float(per_node[i])
        nodes.append(NodeTime(i, label, _shape(node), float(per_node[i])))
    slowest = sorted(nodes, key=lambda t: -t.ms)[:n_slowest]
    floor = float(np.median(idle)) * 1e3 if idle else None
    return Profile(float(per_node.sum()), sorted(table.values(), key=lambda o: -o.ms), slowest, floor,
                   statistics.median(step_ms[3:]), phases)


# --- the PyTorch side ----------------------------------------------------------------------------
def _torch_worker(conn, recipe: str, device: str, threads: int, payload: dict, mode: str = "eager") -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch

    from . import reference

    torch.set_num_threads(threads)
    precision = payload["options"].get("precision", "fp32")
    autocast = torch_precision_setup(torch, precision)
    dev = torch.device(device)
    device_memory = PeakDeviceMemory() if dev.type == "cuda" else None
    base = payload["cfg"].get("base")
    # bf16: the frozen base dequantized to bf16 (as transformers + PEFT users load it), the
    # adapters fp32 master weights under bf16 autocast, as ours
    base_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    forward, loss_fn, cfg = reference.MODELS[recipe], reference.LOSSES[recipe], payload["cfg"]
    if transformers_side(base):
        # a base of another architecture (or with rope scaling): transformers' model of it, with the
        # adapters wrapped in (toyharness/architectures/hf.py); in bf16 with PyTorch's fused
        # attention (SDPA), transformers' default, in fp32/tf32 the eager attention of the parity tests
        from .architectures.hf import add_lora, hf_model

        model = hf_model(base, attention="sdpa" if precision == "bf16" else "eager").to(dtype=base_dtype)
        adapters = add_lora(model, base, payload["params"], payload["options"]["alpha"] / payload["options"]["rank"])
        model.to(dev)                 # the adapters too (made on the host), each keeping its dtype
        trainable, P = list(adapters.values()), {}

        def forward(P, batch, cfg):      # noqa: F811 (the reference's own for every other case)
            return model(input_ids=batch["tokens"].long()).logits
    else:
        P = {n: torch.tensor(a, device=dev, requires_grad=True) for n, a in payload["params"].items()}
        if base:
            P.update({n: torch.from_numpy(a).to(dev, base_dtype) for n, a in base_arrays(base).items()})
        trainable = [p for p in P.values() if p.requires_grad]
    opts = payload["options"]
    kw = {"lr": 1e-3, "betas": (0.9, opts.get("beta2", 0.999)), "eps": 1e-8,
          "weight_decay": opts.get("weight_decay", 0.0)}
    # fused (one kernel per step) where this torch has it for the device, else foreach (multi-tensor)
    try:
        opt = torch.optim.AdamW(trainable, fused=True, **kw)
        flavour = "fused"
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(trainable, foreach=True, **kw)
        flavour = "foreach"
    batches = payload["batches"]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def model_loss(P, batch):
        with autocast(dev):
            return loss_fn(forward(P, batch, cfg), batch)

    # compile: the forward and loss (and so their backward), as nanoGPT compiles its model;
    # the optimizer step stays the fused AdamW
    model_loss = torch.compile(model_loss) if mode == "compile" else model_loss

    def one_step(b: dict) -> float:
        batch = {k: torch.from_numpy(v).to(dev) for k, v in b.items()}
        opt.zero_grad(set_to_none=True)
        loss = model_loss(P, batch)
        loss.backward()
        opt.step()
        return loss.item()            # waits for the device, as toyharness's step does

    conn.send({"ready": True, "optimizer": flavour, "torch": torch.__version__, "mode": mode})
    step = 0
    while True:
        cmd, n = conn.recv()
        if cmd == "steps":
            times = []
            for _ in range(n):
                sync()
                t0 = time.perf_counter()
                one_step(batches[step % N_BATCHES])
                times.append((time.perf_counter() - t0) * 1e3)
                step += 1
            if device_memory is not None:
                device_memory.sample()
            conn.send(times)
        else:
            peak = torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else None
            conn.send({"peak_rss_mb": _peak_rss_mb(), "device_peak_mb": peak,
                       "device_mb": device_memory.peak_mb if device_memory is not None else None})
            return


def _ceiling_worker(conn, threads: int) -> None:
    """Best GFLOP/s of a 2048^3 FP32 sgemm (OpenBLAS, `threads` threads)."""
    from ._ffi import blas

    if blas is None:
        conn.send(None)
        return
    n = 2048
    a = np.random.default_rng(0).random((n, n), dtype=np.float32)
    b = np.random.default_rng(1).random((n, n), dtype=np.float32)
    c = np.empty((n, n), dtype=np.float32)
    blas.lib.scipy_openblas_set_num_threads(threads)
    best = float("inf")
    for _ in range(6):
        t0 = time.perf_counter()
        blas.sgemm(101, 111, 111, n, n, n, 1.0, a.ctypes.data, n, b.ctypes.data, n, 0.0, c.ctypes.data, n)
        best = min(best, time.perf_counter() - t0)
    conn.send(2 * n**3 / best / 1e9)


# --- the driver ----------------------------------------------------------------------------------
@dataclass
class Result:
    recipe: str
    ms_per_step: float
    torch_ms_per_step: float
    items_per_step: int
    item: str
    peak_rss_mb: float
    torch_peak_rss_mb: float
    gflops: float | None
    host_overhead_pct: float | None
    config: dict
    extra: dict = field(default_factory=dict)

    def drift(self) -> dict[str, tuple[float, float]]:
        """Each side's slowest and fastest round median, where they differ by more than
        DRIFT (the machine's speed moved during this recipe's rounds)."""
        rounds = self.extra.get("round_medians_ms", {})
        return {side: (min(v), max(v)) for side, v in rounds.items() if v and max(v) > (1 + DRIFT) * min(v)}

    @property
    def speedup(self) -> float:
        return self.torch_ms_per_step / self.ms_per_step

    def to_json(self, ceiling: float | None) -> dict:
        out = {"ms_per_step": round(self.ms_per_step, 3), "torch_ms_per_step": round(self.torch_ms_per_step, 3),
               "speedup": round(self.speedup, 3),
               f"{self.item}_per_s": round(self.items_per_step / self.ms_per_step * 1e3, 1),
               f"torch_{self.item}_per_s": round(self.items_per_step / self.torch_ms_per_step * 1e3, 1),
               "peak_rss_mb": round(self.peak_rss_mb, 1), "torch_peak_rss_mb": round(self.torch_peak_rss_mb, 1),
               "matmul_gflops": None if self.gflops is None else round(self.gflops, 1),
               "host_overhead_pct": None if self.host_overhead_pct is None else round(self.host_overhead_pct, 2),
               "config": self.config, **self.extra}
        if ceiling and self.gflops:
            out["ceiling_pct"] = round(100 * self.gflops / ceiling, 1)
        return out


def _guarded(conn, target, *args) -> None:
    """Run a worker; an exception goes back to the parent instead of a silent hang."""
    try:
        target(conn, *args)
    except BaseException as exc:  # noqa: BLE001 - re-raised in the parent
        conn.send(exc)


def _spawn(ctx, target, *args):
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_guarded, args=(child, target, *args), daemon=True)
    proc.start()
    return proc, parent


def _reply(conn, what: str):
    if not conn.poll(900):
        raise TimeoutError(f"bench worker gave no answer to {what}")
    out = conn.recv()
    if isinstance(out, BaseException):
        raise out
    return out


def _ask(conn, what):
    conn.send(what)
    return _reply(conn, str(what))


def bench_recipe(recipe: str, backend: str = "cpu", threads: int = 2, steps: int = 20, warmup: int = 3,
                 round_steps: int = 5, torch_device: str | None = None, sets: list[str] | None = None,
                 torch_modes: tuple[str, ...] | None = None) -> Result:
    """One recipe side by side: toyharness and PyTorch at the options' precision (one PyTorch worker
    per mode: `torch_modes`, default the precision's TORCH_MODES, for bf16 torch.compile and
    eager), in alternating rounds."""
    ctx = mp.get_context("spawn")
    gproc, g = _spawn(ctx, _ggml_worker, recipe, backend, threads, list(sets or []))
    procs = []
    try:
        info = _reply(g, "start")
        device = torch_device or ("cuda" if backend == "cuda" else "cpu")
        payload = {k: info[k] for k in ("params", "cfg", "batches", "options")}
        modes = tuple(torch_modes or TORCH_MODES[info["options"].get("precision", "fp32")])
        sides = [g]
        for mode in modes:
            proc, conn = _spawn(ctx, _torch_worker, recipe, device, threads, payload, mode)
            procs.append(proc)
            sides.append(conn)
        try:
            tinfo = [_reply(t, "start") for t in sides[1:]][0]
            trips = [cpu_round_trip_ns()] if backend == "cpu" and threads > 1 else []
            for conn in sides:
                _ask(conn, ("steps", warmup))
            sinks: list[list] = [[] for _ in sides]
            rounds = max(2, -(-steps // round_steps))
            for r in range(rounds):
                order = list(range(len(sides)))
                for i in (order if r % 2 == 0 else order[::-1]):
                    time.sleep(SETTLE_S)
                    sinks[i].append(_ask(sides[i], ("steps", round_steps)))
            if trips:
                trips.append(cpu_round_trip_ns())
            timed, theirs = sinks[0], sinks[1:]
            names = ["pytorch"] + [f"pytorch_{mode}" for mode in modes[1:]]
            by_round = {"toyharness": [statistics.median(ms for ms, _ in rnd) for rnd in timed],
                        **{name: [statistics.median(rnd) for rnd in t] for name, t in zip(names, theirs)}}
            timed = [x for rnd in timed for x in rnd]
            theirs = [[x for rnd in t for x in rnd] for t in theirs]
            mine = _ask(g, ("done", 0))
            others = [_ask(t, ("done", 0)) for t in sides[1:]]
        finally:
            for proc in procs:
                proc.join(30)
    finally:
        gproc.join(30)
    ours = [ms for ms, _ in timed]
    ms = statistics.median(ours)
    host = [h for _, h in timed if h is not None]
    overhead = 100 * max(0.0, statistics.median(host)) / ms if host else None
    item = "images" if "images" in info["batches"][0] else "tokens"
    gflops = mine["flops"] / (ms / 1e3) / 1e9 if mine["flops"] else None
    extra = {"torch_optimizer": tinfo["optimizer"], "torch_version": tinfo["torch"], "timed_steps": len(ours),
             "fingerprint": info["fingerprint"], "precision": info["options"].get("precision", "fp32"),
             "torch_mode": modes[0],
             "round_medians_ms": {side: [round(x, 3) for x in v] for side, v in by_round.items()}}
    for mode, t in zip(modes[1:], theirs[1:]):     # bf16: PyTorch eager beside torch.compile
        extra[f"torch_{mode}_ms_per_step"] = round(statistics.median(t), 3)
        extra[f"speedup_vs_torch_{mode}"] = round(statistics.median(t) / ms, 3)
    if trips and None not in trips:
        extra["cpu_round_trip_ns"] = trips
    if others[0].get("device_peak_mb") is not None:
        extra["torch_device_peak_mb"] = round(others[0]["device_peak_mb"], 1)   # its allocator's peak
    # each process's memory on the GPU as the driver counts it (toyharness/device_memory.py)
    if mine.get("device_mb") is not None:
        extra["device_mb"] = round(mine["device_mb"], 1)
    for key in ("bf16_copies_mb", "bf16_copies_peak_mb"):
        if mine.get(key) is not None:
            extra[key] = round(mine[key], 1)
    for mode, other in zip(modes, others):
        if other.get("device_mb") is not None:
            extra["torch_device_mb" if mode == modes[0] else f"torch_{mode}_device_mb"] = round(other["device_mb"], 1)
    return Result(recipe, ms, statistics.median(theirs[0]), info["items"], item, mine["peak_rss_mb"],
                  others[0]["peak_rss_mb"], gflops, overhead, _short_config(info["options"]), extra)


def _short_config(options: dict) -> dict:
    keep = ("n_layer", "d_model", "n_head", "n_kv_head", "d_ff", "t_seq", "t_batch", "patch", "rank", "targets",
            "base", "donor_d_in")
    out = {k: options[k] for k in keep if k in options}
    if out.get("base"):
        out["base"] = os.path.basename(out["base"])
    return out


def matmul_ceiling(threads: int) -> float | None:
    ctx = mp.get_context("spawn")
    proc, conn = _spawn(ctx, _ceiling_worker, threads)
    try:
        return _reply(conn, "ceiling")
    finally:
        proc.join(30)
