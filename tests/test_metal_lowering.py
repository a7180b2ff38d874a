"""Graphs the pinned ggml-metal can run: every recipe's training graphs, lowered for metal's
declarations (toyharness/engine/lowering.py, Program.lowering_target "metal"), hold only nodes that
the port of ggml_metal_device_supports_op (toyharness/engine/metal_ops.py) accepts, and they train
to within 1e-6 relative of the normal graphs' goldens over 16 steps. The port is held to the
pinned source by a checksum of the function's text.

TOYHARNESS_TEST_BACKEND=vulkan runs the same on vulkan (tests/test_vulkan.py does, on lavapipe)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from helpers import native_build

from toyharness import goldens
from toyharness._ffi import available_native_backends, ffi, lib
from toyharness.engine import blocks, get_engine
from toyharness.engine.lowering import RULES
from toyharness.engine.metal_ops import METAL_FUNCTIONS, METAL_SOURCE, METAL_SUPPORTS_OP_SHA256, metal_refusal
from toyharness.engine.program import Program
from toyharness.switches import switch

ROOT = Path(__file__).resolve().parent.parent
GOLDEN_NAMES = ["gpt2", "llama", "lora", "vit_tiny", "warm_start", "lora@q4_k", "lora@q8_0",
                "lora@llama3", "lora@qwen3", "lora@gemma3", "lora@phi3", "gpt2@dropout", "lora@dropout", "dpo",
                "orpo"]
BACKEND = switch("TOYHARNESS_TEST_BACKEND")
if BACKEND not in available_native_backends():
    pytestmark = pytest.mark.skip(reason=f"TOYHARNESS_TEST_BACKEND={BACKEND}: that backend is not built into this "
                                         "install or has no device")
# the ops ggml-metal lacks that our graphs hold (each must be gone once lowered)
METAL_LACKS = {"OUT_PROD", "CROSS_ENTROPY_LOSS", "CROSS_ENTROPY_LOSS_BACK", "SOFT_MAX_BACK", "RMS_NORM_BACK",
               "GET_ROWS_BACK", "REPEAT_BACK"}


def function_text(source: str, signature: str) -> str:
    start = source.index(signature)
    return source[start:source.index("\n}\n", start) + 3]


def test_the_port_is_of_the_pinned_metal_supports_op():
    """A ggml upgrade that changes these functions fails here: read them again, port the change,
    then update the checksum."""
    source = (native_build().ggml_source() / METAL_SOURCE).read_text()
    text = "".join(function_text(source, sig) for sig in METAL_FUNCTIONS)
    assert "case GGML_OP_OUT_PROD" not in text and "case GGML_OP_CROSS_ENTROPY_LOSS" not in text
    assert hashlib.sha256(text.encode()).hexdigest() == METAL_SUPPORTS_OP_SHA256


def trainer_for(name: str, monkeypatch, lowering: str):
    from toyharness.discovery import get_recipe
    from toyharness.hookspecs import plugin_manager
    from toyharness.runner import load_data, resolve_options

    monkeypatch.setattr(Program, "lowering_target", lowering)
    _, obj = get_recipe(goldens.split_name(name)[0])
    opts = resolve_options(obj, None, goldens.golden_sets_for(name), {})
    pm = plugin_manager(obj)
    return pm.hook.realize(engine=get_engine(BACKEND), options=opts, data=load_data(pm, opts)).trainer


def graph_ops(graph) -> list:
    return [lib.ggml_graph_node(graph, i) for i in range(lib.ggml_graph_n_nodes(graph))]


def op_of(node) -> str:
    return ffi.string(lib.ggml_op_desc(node)).decode()


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_every_node_of_every_lowered_graph_is_one_metal_declares(name, monkeypatch):
    trainer = trainer_for(name, monkeypatch, "metal")
    lowered = {entry.split(" ->")[0] for entry in trainer.prog.lowering.lowered}
    assert lowered, "nothing was lowered: the graph held none of the ops metal lacks?"
    for label, graph in (("training", trainer.gb_opt), ("evaluation", trainer.eval_graph)):
        for i, node in enumerate(graph_ops(graph)):
            why = metal_refusal(node)
            node_name = ffi.string(lib.ggml_get_name(node)).decode()
            assert why is None, f"{name}: the {label} graph's node {i} ({op_of(node)}, {node_name!r}): {why}"
    # and without the lowering the same graph holds ops metal lacks (the check can fail)
    plain = trainer_for(name, monkeypatch, "")
    assert METAL_LACKS & {op_of(n) for n in graph_ops(plain.gb_opt)}


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_lowered_graphs_train_as_the_normal_ones(name, monkeypatch):
    """16 steps of the golden config, lowered for metal, against this backend's golden (normal
    graphs): within 1e-6 relative at every step."""
    monkeypatch.setattr(Program, "lowering_target", "metal")
    doc = goldens.compute(name, BACKEND)
    path = goldens.path_for(name, doc["fingerprint"], ROOT / "goldens")
    if not path.is_file():
        pytest.skip(f"no golden of the normal graphs for this machine at {path}")
    ours = np.array([x["value"] for x in doc["losses"]], np.float64)
    ref = np.array([x["value"] for x in goldens.load(path)["losses"]], np.float64)
    worst = float(np.max(np.abs(ours - ref) / np.abs(ref)))
    print(f"{name} {BACKEND} lowered for metal: largest relative difference to {path.parent.name} {worst:.3g}")
    assert len(ours) == 16 and worst < 1e-6


def build_for(op: str, prog, P):
    """A small graph whose backward holds `op` (and others of the list)."""
    if op in ("SOFT_MAX_BACK", "OUT_PROD", "RMS_NORM_BACK"):
        w = prog.constant("weights", np.random.default_rng(6).normal(size=(3, 4, 8)).astype(np.float32))
        return prog.scalar_loss((blocks.rms_norm(P["x"], P["g"]).matmul_t(P["w"]).softmax() * w).sum())
    ids = prog.constant("ids", np.array([1, 5, 5, 31, 0, 2], np.int32))
    logits = P["emb"].get_rows(ids).reshape(12, 8) + P["b"]          # GET_ROWS_BACK, REPEAT_BACK (the bias)
    return prog.cross_entropy(logits, "targets")                      # CROSS_ENTROPY_LOSS(_BACK)


@pytest.mark.parametrize("op", sorted(RULES))
def test_each_rewrite_leaves_no_node_of_its_op_and_the_same_gradients(op, monkeypatch):
    """Lowered for metal, the op is gone, and the loss and every gradient agree with the
    unlowered graph's to 1e-6."""
    rng = np.random.default_rng(5)
    init = {"x": rng.normal(size=(3, 4, 16)), "g": rng.normal(size=16), "w": rng.normal(size=(8, 16)),
            "emb": rng.normal(size=(32, 16)), "b": rng.normal(size=8)}
    results = {}
    for mode in ("none", "metal"):
        monkeypatch.setattr(Program, "lowering_target", "" if mode == "none" else mode)
        prog = get_engine(BACKEND).program()
        prog.cpu_folds = False      # the nodes as built (a cpu Trainer would fold RMS_NORM_BACK's gain)
        used = ["x", "g", "w"] if op in ("SOFT_MAX_BACK", "OUT_PROD", "RMS_NORM_BACK") else ["emb", "b"]
        P = {k: prog.param(k, init[k].astype(np.float32)) for k in used}
        loss = build_for(op, prog, P)
        trainer = prog.trainer(loss, "bias_corrected")
        ops = {op_of(n) for n in graph_ops(trainer.gb_grad)}    # (before the cpu kernels' rewrite)
        value = trainer.grads_only({"targets": np.arange(12) % 8} if "targets" in prog._targets else {})
        results[mode] = (value, {k: prog.read(trainer.grad_acc[k]) for k in used}, ops)
    assert op in results["none"][2] and op not in results["metal"][2]
    assert abs(results["metal"][0] - results["none"][0]) <= 1e-6 * abs(results["none"][0])
    for k, ref in results["none"][1].items():
        got = results["metal"][1][k]
        assert np.linalg.norm(got - ref) <= 1e-6 * np.linalg.norm(ref) + 1e-7, k

