"""Shared fixtures: a small llama base model made by the harness itself (no download), and programs
built as another backend builds them."""

import pytest

from toyharness.runner import train


def pytest_collection_modifyitems(config, items):
    # tests/test_vulkan.py (minutes: its lavapipe child run) collected first: under `pytest -n`
    # (pytest-xdist, a module a worker) it starts at once beside the rest instead of alone at the end;
    # the sort is stable, so the rest keep their order
    items.sort(key=lambda item: item.path.name != "test_vulkan.py")
    # tests marked slow (minutes of compiling or training) are `nox -s slow`'s: skipped, saying so,
    # unless a -m expression picks tests (`pytest -m slow`)
    if not config.option.markexpr:
        skip = pytest.mark.skip(reason="slow, not in the default suite: `nox -s slow` (pytest -m slow) runs it")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)


def pytest_addoption(parser):
    parser.addoption("--kill-trials", type=int, default=5,
                     help="tests/test_hostile_machine.py: SIGKILL trials (nox -s fuzz runs 40)")
    parser.addoption("--kill-seed", type=int, default=0, help="tests/test_hostile_machine.py: the trials' seed")


@pytest.fixture
def programs_built_as(monkeypatch):
    """programs_built_as(cpu_folds=False, ...): every Program made later in the test gets those
    attributes once its __init__ has run (a test that builds on the cpu the graphs another backend
    computes: no cpu folds, kv heads repeated, column sums as products)."""
    from toyharness.engine.program import Program

    def apply(**attrs):
        init = Program.__init__

        def built(self, *args, **kwargs):
            init(self, *args, **kwargs)
            for name, value in attrs.items():
                assert hasattr(self, name), name
                setattr(self, name, value)

        monkeypatch.setattr(Program, "__init__", built)

    return apply


BASE_SETS = ["n_layer=2", "d_model=64", "n_head=4", "n_kv_head=2", "d_ff=128", "t_seq=32", "t_batch=8",
             "eval_every=300", "checkpoint_every=300", "lr=1e-2"]


@pytest.fixture(scope="session")
def llama_base(tmp_path_factory):
    """A short `llama` run on the embedded corpus, exported: the base for LoRA and the donor for
    warm start."""
    out = tmp_path_factory.mktemp("base") / "run"
    train("llama", steps=300, sets=BASE_SETS, out=str(out), progress=False)
    return out / "model.gguf"


@pytest.fixture(scope="session")
def other_text(tmp_path_factory):
    """A different slice of English than the embedded corpus: stdlib docstrings."""
    import argparse
    import collections
    import json
    import logging
    import pathlib
    import subprocess

    mods = [argparse, collections, json, logging, pathlib, subprocess]
    docs = (getattr(getattr(m, n), "__doc__", None) for m in mods for n in sorted(dir(m)))
    text = "\n\n".join(d for d in docs if isinstance(d, str))
    path = tmp_path_factory.mktemp("text") / "docstrings.txt"
    path.write_text(text)
    return path


@pytest.fixture
def graphs_as_cuda_builds_them(programs_built_as):
    """The cuda rewrite's tests (tests/test_cuda_*.py) build on cpu the graphs cuda would compute: a
    cpu Trainer's folds of products into ADDs (th_cpu_fold) and grouped kv heads read in place
    without their REPEATs (Program.kv_in_place) are not cuda's, so they stay off there."""
    programs_built_as(cpu_folds=False, kv_in_place=False)
