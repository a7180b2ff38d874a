"""docs/benchmarks.md is generated from benchmarks/*.json (tools/benchmarks_page.py): the committed
page must be the generator's output, and a bench file that lacks what the page shows is refused by
name."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "benchmarks_page.py"


def page_module():
    spec = importlib.util.spec_from_file_location("benchmarks_page", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_page_is_the_generators_output():
    r = subprocess.run([sys.executable, str(TOOL), "--check"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert sorted(ROOT.glob("benchmarks/*.json")), "no bench file in benchmarks/"


def test_every_recorded_figure_is_on_the_page():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    for path in sorted(ROOT.glob("benchmarks/*.json")):
        doc = json.loads(path.read_text())
        assert doc["machine"] in text and doc["fingerprint"] in text
        assert doc["commit"] not in text, "the page names no commit (its file does)"
        if doc["backend"] == "cpu":
            assert f"SIMD {doc['simd']}, BLAS {doc['blas']}" in text
        for recipe, r in doc["recipes"].items():
            assert f"| `{recipe}` |" in text and f"{r['ms_per_step']:.2f}" in text


def _bench_file(**drop) -> dict:
    doc = {"machine": "a test machine", "commit": "0" * 40, "backend": "cpu", "precision": "fp32",
           "fingerprint": "cpu-avx2-openblas-haswell", "simd": "avx2", "blas": "OpenBLAS Haswell", "threads": 2,
           "size": "default", "steps": 20, "torch_modes": ["eager"],
           "recipes": {"gpt2": {"ms_per_step": 10.0, "torch_ms_per_step": 15.0, "speedup": 1.5,
                                "config": {"n_layer": 2, "targets": ["q", "v"]}}}}
    for key in drop:
        doc.pop(key)
    return doc


def test_a_file_is_rendered_with_its_machine_build_and_ratio(tmp_path):
    (tmp_path / "one.json").write_text(json.dumps(_bench_file()))
    text = page_module().render(tmp_path)
    assert "| machine | a test machine |" in text and "SIMD avx2, BLAS OpenBLAS Haswell" in text
    assert "| `gpt2` | n_layer 2, targets q,v | 10.00 | 15.00 | 1.50x |" in text


@pytest.mark.parametrize("key", ["machine", "commit", "simd", "blas", "precision", "backend"])
def test_a_file_without_a_key_is_refused_naming_it(tmp_path, key):
    mod = page_module()
    (tmp_path / "bad.json").write_text(json.dumps(_bench_file(**{key: True})))
    with pytest.raises(mod.BenchFileError, match=f"bad.json: no {key}"):
        mod.render(tmp_path)


def test_pytorchs_figures_may_be_null_only_where_the_file_says_why(tmp_path):
    mod = page_module()
    doc = _bench_file()
    doc["recipes"]["gpt2"].update(torch_ms_per_step=None, speedup=None)
    (tmp_path / "ours.json").write_text(json.dumps(doc))
    with pytest.raises(mod.BenchFileError, match="recipe gpt2: PyTorch's figures are null and pytorch_side"):
        mod.render(tmp_path)
    doc["pytorch_side"] = "not measured: no PyTorch here"
    (tmp_path / "ours.json").write_text(json.dumps(doc))
    assert "| `gpt2` | n_layer 2, targets q,v | 10.00 | not measured | - |" in mod.render(tmp_path)


def test_a_gpu_file_needs_no_simd_or_blas_and_shows_its_backend(tmp_path):
    doc = _bench_file(simd=True, blas=True)
    doc.update(backend="cuda", fingerprint="cuda-sm90")
    (tmp_path / "gpu.json").write_text(json.dumps(doc))
    text = page_module().render(tmp_path)
    assert "| build | cuda (cuda-sm90) |" in text and "SIMD" not in text.split("## cuda")[1]
