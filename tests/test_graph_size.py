"""Graphs sized to the model (Program._new_graph): each holds what it needs and no more, a deep
model's backward fits the scratch graph it is first counted in, and a graph too large for its
program is an error, not ggml's abort.

ggml aborts the whole process when a graph overflows, so the models are built in a child
process: an abort there fails the test with ggml's message instead of ending the suite.
"""

import json
import subprocess
import sys

import pytest

from toyharness.engine.gguf_io import copy_gguf_as
from toyharness.lm import seeded_model_file

# Each graph of a trainer: its nodes, leafs and size; the program's capacity; the parameters.
MEASURE = """
import json, sys
from toyharness._ffi import lib
from toyharness.engine import get_engine
from toyharness.engine.program import BACKWARD_TENSORS_PER_NODE
from toyharness.hookspecs import plugin_manager
from toyharness.discovery import get_recipe
from toyharness.runner import load_data, resolve_options
recipe, sets = sys.argv[1], json.loads(sys.argv[2])
_, obj = get_recipe(recipe)
opts = resolve_options(obj, None, sets, {})
pm = plugin_manager(obj)
model = pm.hook.realize(engine=get_engine("cpu", 1), options=opts, data=load_data(pm, opts))
tr = model.trainer
graphs = {name: {"nodes": lib.ggml_graph_n_nodes(g), "leafs": lib.th_graph_n_leafs(g), "size": lib.ggml_graph_size(g)}
          for name, g in (("gf", tr.gf), ("gb_grad", tr.gb_grad), ("gb_opt", tr.gb_opt), ("eval", tr.eval_graph))}
print(json.dumps({"graphs": graphs, "params": len(tr.prog.params), "capacity": tr.prog.capacity,
                  "per_node": BACKWARD_TENSORS_PER_NODE}))
"""

DEEP = ["d_model=32", "n_head=2", "t_seq=8", "t_batch=2"]
LLAMA_30 = ["n_layer=30", "d_model=64", "n_head=4", "n_kv_head=2", "d_ff=128"]


@pytest.fixture(scope="module")
def base_30_layers(tmp_path_factory):
    """A 30-layer llama (SmolLM2's depth) at a tiny width, in q8_0: lora's deepest graphs."""
    return copy_gguf_as(seeded_model_file("llama", LLAMA_30), tmp_path_factory.mktemp("deep") / "base.gguf", "q8_0")


def measure(recipe: str, sets: list[str]) -> dict:
    res = subprocess.run([sys.executable, "-c", MEASURE, recipe, json.dumps(sets)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, f"{recipe} {sets}: {res.stderr[-2000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("recipe,sets", [
    ("gpt2", ["n_layer=48", *DEEP]),
    ("gpt2", ["n_layer=12", "d_model=48", "n_head=12", "t_seq=8", "t_batch=2"]),   # gpt2-small's layout
    ("llama", ["n_layer=48", "untied=true", "qkv_bias=true", *DEEP]),
    ("vit_tiny", ["n_layer=24", "d_model=32", "n_head=2", "d_ff=64", "t_batch=4"]),
    ("lora", ["targets=q,k,v,o,gate,up,down", "t_seq=8", "t_batch=2"]),
    ("lora", ["targets=q,k,v,o,gate,up,down", "t_seq=8", "t_batch=2", "portable=true"]),
])
def test_deep_models_get_graphs_of_their_own_size(recipe, sets, base_30_layers):
    if recipe == "lora":
        sets = [f"base={base_30_layers}", *sets]
    got = measure(recipe, sets)
    g, n_params = got["graphs"], got["params"]
    for name in ("gf", "eval"):      # exactly what they hold: ggml needs nodes and leafs <= size
        assert g[name]["size"] == max(g[name]["nodes"], g[name]["leafs"]), (name, g)
    # the backward's, plus room for a copy of each parameter's gradient that is not contiguous
    # (the Trainer keeps gradients as graph outputs; most need no copy)
    grad = g["gb_grad"]
    assert max(grad["nodes"], grad["leafs"]) <= grad["size"] <= max(grad["nodes"], grad["leafs"]) + n_params, g
    opt = g["gb_opt"]
    # a cont and a step per parameter, the AdamW row and, where vectors step without weight
    # decay, its second row
    assert max(opt["nodes"], opt["leafs"]) <= opt["size"] <= g["gb_grad"]["size"] + 2 * n_params + 2
    # the scratch graph the backward is counted in holds it, with room to spare on a deep model
    scratch = g["gf"]["size"] + g["gf"]["nodes"] * (1 + got["per_node"])
    assert g["gb_grad"]["nodes"] + g["gb_grad"]["leafs"] <= scratch / 2, g
    assert g["gb_opt"]["size"] < got["capacity"] / 4, "the graphs did not shrink to the model"


TOO_LARGE = """
import numpy as np
from toyharness.engine import get_engine
from toyharness.engine.program import Program
from toyharness.errors import ShapeError
prog = Program(get_engine("cpu", 1), capacity=256)
x = prog.param("p0", np.ones(4, np.float32))
for i in range(1, 60):            # 59 products of 60 parameters: ~300 nodes with the backward
    x = x * prog.param(f"p{i}", np.full(4, 1.01, np.float32))
try:
    prog.trainer(prog.scalar_loss(x.sum()), "bias_corrected")
except ShapeError as e:
    print("refused:", e)
"""


def test_a_graph_larger_than_the_capacity_is_refused_not_aborted():
    res = subprocess.run([sys.executable, "-c", TOO_LARGE], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "refused: a graph of" in res.stdout and "larger than 256" in res.stdout, res.stdout
