"""Helpers the test modules share, from one place (pytest puts tests/ on sys.path: `from helpers
import cli`). A test module imports these, never another test module."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from toyharness._ffi import available_native_backends, ffi, lib
from toyharness.switches import switch

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str | Path, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """`toyharness ARGS...` in a process of its own, its output captured as text; `kwargs` go to
    subprocess.run (env, cwd, preexec_fn)."""
    return subprocess.run([sys.executable, "-m", "toyharness.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, **kwargs)


def native_build() -> ModuleType:
    """native/build.py loaded as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("toyharness_native_build", ROOT / "native" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def needs(backend: str) -> list:
    """The marks of a test that needs `backend`: its marker, and a skip saying why where it is absent."""
    reason = f"the {backend} backend is not built into this install (TOYHARNESS_BACKENDS=cpu,{backend}) or no device"
    try:
        present = backend in available_native_backends()
    except Exception:
        present = False
    return [getattr(pytest.mark, backend), pytest.mark.skipif(not present, reason=reason)]


def gelu_tanh_f64(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GELU's tanh form and its derivative, in float64."""
    c = np.sqrt(2 / np.pi)
    u = c * (x + 0.044715 * x ** 3)
    t = np.tanh(u)
    return 0.5 * x * (1 + t), 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)


def gelu_erf_f64(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The exact GELU x Phi(x) and its derivative Phi(x) + x phi(x), in float64."""
    phi = 0.5 * (1 + np.vectorize(math.erf)(x / np.sqrt(2)))
    return x * phi, phi + x * np.exp(-0.5 * x * x) / np.sqrt(2 * np.pi)


def relative_error(ours, theirs) -> float:
    return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


def kl_and_top1(ref: np.ndarray, other: np.ndarray) -> tuple[float, float]:
    """Mean KL(softmax(ref) || softmax(other)) over positions, and how often their argmax agree."""
    def log_softmax(x):
        x = x.astype(np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    lp, lq = log_softmax(ref), log_softmax(other)
    kl = float(np.mean(np.sum(np.exp(lp) * (lp - lq), -1)))
    return kl, float(np.mean(ref.argmax(-1) == other.argmax(-1)))


def llama_cpp_logits(model: Path, ids: list[int], tmp_path: Path, lora: tuple[Path, float] | None = None):
    """llama.cpp's logits for `ids` on `model` (and an adapter), from the th_logits tool that
    TOYHARNESS_LLAMACPP_TOOL names (`nox -s llamacpp` builds it)."""
    tool = switch("TOYHARNESS_LLAMACPP_TOOL")
    out = tmp_path / "logits.f32"
    extra = ["--lora", str(lora[0]), str(lora[1])] if lora else []
    res = subprocess.run([tool, str(model), str(out), *extra, *map(str, ids)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    n, vocab = map(int, res.stdout.split())
    return np.fromfile(out, dtype=np.float32).reshape(n, vocab)


def adapter_replay_start(run_dir, recipe: str, base_path, hf_overrides: dict | None = None):
    """What replaying an adapter run folder (config.toml, init.gguf, batches.npz) in transformers
    starts from: the run's options, transformers' model of the base with the run's initial
    adapters added, those adapters by name, AdamW's zeroed moments (m, v) and the run's batches."""
    import torch

    from toyharness.architectures.hf import add_lora, hf_model
    from toyharness.discovery import get_recipe
    from toyharness.engine import GGUFFile
    from toyharness.options import read_toml, resolve_options
    from toyharness.run_files import read_batches_npz

    _, obj = get_recipe(recipe)
    opts = resolve_options(obj, str(run_dir / "config.toml"), [], {})
    assert read_toml(run_dir / "config.toml")["recipe"] == recipe
    model = hf_model(base_path, hf_overrides or {})
    with GGUFFile(run_dir / "init.gguf") as f:
        init = {n: f.tensor(n).to_numpy() for n in f.names}
    params = add_lora(model, base_path, init, opts.alpha / opts.rank)
    m = {n: torch.zeros_like(p) for n, p in params.items()}
    v = {n: torch.zeros_like(p) for n, p in params.items()}
    return opts, model, params, m, v, read_batches_npz(run_dir / "batches.npz")


def transformers_replay(run_dir, base_path, hf_overrides: dict, steps: int = 8) -> list[float]:
    """The first `steps` losses of a lora run folder (its init.gguf and batches.npz) replayed by
    transformers' model of the base's architecture, with the run's own AdamW rows."""
    import torch

    from toyharness.bench.torch_side import adamw_row_step, lm_loss

    opts, model, train_params, m, v, batches = adapter_replay_start(run_dir, "lora", base_path, hf_overrides)
    losses = []
    for i in range(steps):
        batch = {k: torch.from_numpy(np.array(batches[k][i])) for k in batches}
        for p in train_params.values():
            p.grad = None
        loss = lm_loss(model(input_ids=batch["tokens"].long()).logits, batch)
        loss.backward()
        losses.append(float(loss.detach()))
        adamw_row_step(train_params, m, v, opts.adamw_row().hp_for_step(i))
    return losses


# --- graphs as cuda builds them (built on cpu, never computed here) --------------------------------
def cuda_kernel_names(graph) -> list[str]:
    """The names of our cuda kernels the rewrite put on the graph's nodes, in node order."""
    names = (lib.th_cuda_kernel_name(lib.ggml_graph_node(graph, i)) for i in range(lib.ggml_graph_n_nodes(graph)))
    return [ffi.string(n).decode() for n in names if n != ffi.NULL]


def cuda_node_name(t) -> str:
    """Our cuda kernel's name for a node, else ggml's op."""
    kernel = lib.th_cuda_kernel_name(t)
    return ffi.string(kernel).decode() if kernel != ffi.NULL else ffi.string(lib.ggml_op_desc(t)).decode()


def graph_nodes(graph) -> list:
    return [lib.ggml_graph_node(graph, i) for i in range(lib.ggml_graph_n_nodes(graph))]


def linear_bias_calls() -> tuple[int, int]:
    """LINEAR_BIAS nodes computed so far in this process: (by cuBLASLt, by the plain path)."""
    lt, plain = ffi.new("int64_t *"), ffi.new("int64_t *")
    lib.th_cuda_linear_bias_calls(lt, plain)
    return lt[0], plain[0]


def as_cuda_builds_it(recipe: str, sets: list[str], precision: str, monkeypatch):
    """The recipe's model on a cpu program whose graphs are built and rewritten as cuda's
    (our cuda kernels' stand-ins, native/cuda_rewrite.c, the precision stamp; never computed
    here): the training graph is rewritten as a step's first compute would (with recompute,
    recompute.apply did that already)."""
    from toyharness.discovery import get_recipe
    from toyharness.engine import get_engine
    from toyharness.engine.program import Program
    from toyharness.hookspecs import plugin_manager
    from toyharness.runner import load_data, resolve_options

    real_init = Program.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.cpu_kernels = self.cpu_folds = self.kv_in_place = False
        self.cuda_kernels = self.onehot_in_graph = self.column_sums_as_products = True
        self.precision, self.frozen_bf16 = precision, precision == "bf16"

    monkeypatch.setattr(Program, "__init__", init)
    _, obj = get_recipe(recipe)
    options = resolve_options(obj, None, sets, {})
    pm = plugin_manager(obj)
    engine = get_engine("cpu")
    model = pm.hook.realize(engine=engine, options=options, data=load_data(pm, options))
    trainer = model.trainer
    for graph in (trainer.gb_opt, trainer.gb_grad):
        model.prog._prepare(graph)
    return model.prog, trainer, engine


def kernel_names_in_order(graph) -> list[str]:
    """Our cuda kernel's name for each node of the graph ("" for ggml's own), in node order."""
    out = []
    for i in range(lib.ggml_graph_n_nodes(graph)):
        name = lib.th_cuda_kernel_name(lib.ggml_graph_node(graph, i))
        out.append(ffi.string(name).decode() if name != ffi.NULL else "")
    return out


def ops_of(graph) -> list[str]:
    """ggml's op for each node of the graph, in node order."""
    return [ffi.string(lib.ggml_op_desc(lib.ggml_graph_node(graph, i))).decode()
            for i in range(lib.ggml_graph_n_nodes(graph))]


def fd_grad(f, arrays, key, h: float = 1e-6):
    """Central finite differences of the scalar f(arrays) with respect to arrays[key] (a dict of
    arrays by name, or a list by index), each element moved by +-h in place and put back."""
    import numpy as np

    x = arrays[key]
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + h
        fp = f(arrays)
        x[i] = old - h
        fm = f(arrays)
        x[i] = old
        g[i] = (fp - fm) / (2 * h)
    return g
