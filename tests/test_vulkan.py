"""The vulkan backend in the default suite, on Mesa's lavapipe (llvmpipe, a Vulkan device on the
CPU): a ggml build with vulkan is made (cached in ~/.cache/toyharness like every build) into a
folder of its own, and the op checks (tests/test_engine_ops.py), the golden checks
(tests/test_backends.py -m vulkan) and packing's and dropout's vulkan cases run against it in one
child pytest, whose report each test below reads for its module. Where Debian's packages are
absent, these skip and name the apt-get line.

`nox -s tests-vulkan` runs these and the slower vulkan checks that the default suite leaves to it:
the graphs lowered for metal (tests/test_metal_lowering.py), every frozen type's products and
lora (tests/test_quant.py -m vulkan), and the dpo@q4_k and orpo@q4_k goldens, about three minutes
on lavapipe.

ggml skips CPU devices unless GGML_VK_VISIBLE_DEVICES names them: lavapipe is device 0 here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import native_build

ROOT = Path(__file__).resolve().parent.parent
APT_LINE = "apt-get install -y glslc libvulkan-dev spirv-headers mesa-vulkan-drivers"
# what the build and lavapipe need, each from the package named beside it
NEEDED = {
    "glslc": lambda: shutil.which("glslc") is not None,
    "libvulkan-dev": lambda: Path("/usr/include/vulkan/vulkan.hpp").is_file(),
    "spirv-headers": lambda: Path("/usr/include/spirv/unified1/spirv.hpp").is_file(),
    "mesa-vulkan-drivers (lavapipe)": lambda: any(Path("/usr/share/vulkan/icd.d").glob("lvp_icd*.json")),
}
MISSING = [name for name, present in NEEDED.items() if not present()]
def needs_lavapipe(test):
    test = pytest.mark.skipif(bool(MISSING), reason=f"no {', '.join(MISSING)}: {APT_LINE}")(test)
    return pytest.mark.skipif(sys.platform != "linux", reason="lavapipe checks are for Linux (Debian's packages)")(test)


@pytest.fixture(scope="session")
def vulkan_native(tmp_path_factory) -> Path:
    """The libraries of a cpu+vulkan build (a cold build takes minutes; then seconds)."""
    out = tmp_path_factory.mktemp("vulkan") / "native"
    env = {**os.environ, "TOYHARNESS_BACKENDS": "cpu,vulkan"}
    proc = subprocess.run([sys.executable, str(ROOT / "native" / "build.py"), "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, f"the vulkan build failed:\n{proc.stderr[-4000:]}"
    assert (out / "libggml-vulkan.so.0").is_file(), sorted(p.name for p in out.iterdir())
    return out


# What the child pytest runs: every op and block (TOYHARNESS_TEST_BACKEND=vulkan, which that module
# reads), and the tests marked vulkan of the golden, packing and dropout modules. One process for
# all: ggml-vulkan compiles each pipeline once per process (on lavapipe, LLVM compiling its
# shaders), and most are shared.
CHILD_FILES = ["tests/test_engine_ops.py", "tests/test_backends.py", "tests/test_packing.py", "tests/test_dropout.py"]
# -k matches markers too: all of the first module, and the vulkan-marked tests of the others but for
# the goldens left to nox -s tests-vulkan (15 s to a minute and a half each on lavapipe): vit_tiny, dpo
# and orpo (their products the ones lora's and lora@q4_k's check), lora@q8_0 and lora@gemma3 (lora
# over gemma3's packed step stays, in test_packing)
CHILD_SELECTION = "test_engine_ops or (vulkan and not (vit_tiny or dpo or orpo or q8_0 or gemma3))"


@dataclass
class ChildResults:
    """The child pytest's outcome per module: {module: {"passed": [...], "skipped": [(id, reason)],
    "failed": [(id, message)]}}, and its output's tail."""

    modules: dict[str, dict[str, list]]
    output: str

    def of(self, module: str) -> dict[str, list]:
        return self.modules.get(module, {"passed": [], "skipped": [], "failed": []})


@pytest.fixture(scope="module")
def vulkan_child(vulkan_native, tmp_path_factory) -> ChildResults:
    report = tmp_path_factory.mktemp("vulkan-child") / "junit.xml"
    env = {**os.environ, "TOYHARNESS_NATIVE_DIR": str(vulkan_native), "TOYHARNESS_TEST_BACKEND": "vulkan"}
    env.setdefault("GGML_VK_VISIBLE_DEVICES", "0")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           f"--junitxml={report}", "-k", CHILD_SELECTION, *CHILD_FILES],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    output = proc.stdout + proc.stderr
    assert report.is_file(), f"the child pytest wrote no report (exit {proc.returncode}):\n{output[-6000:]}"
    modules: dict[str, dict[str, list]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        module = next((part for part in case.get("classname", "").split(".") if part.startswith("test_")), "")
        got = modules.setdefault(module, {"passed": [], "skipped": [], "failed": []})
        name = case.get("name", "")
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            got["failed"].append((name, (bad.get("message") or "") + (bad.text or "")[-2000:]))
        elif skip is not None:
            got["skipped"].append((name, skip.get("message") or ""))
        else:
            got["passed"].append(name)
    # an error outside the tests (collection, a fixture) is a testcase with an error in the report
    return ChildResults(modules, output[-6000:])


def outcome(child: ChildResults, module: str) -> dict[str, list]:
    got = child.of(module)
    print(f"{module} on vulkan: {len(got['passed'])} passed, {len(got['skipped'])} skipped, "
          f"{len(got['failed'])} failed")
    assert not got["failed"], "\n\n".join(f"{name}: {message}" for name, message in got["failed"])
    return got


@needs_lavapipe
def test_every_op_and_block_on_vulkan_against_float64_numpy(vulkan_child):
    got = outcome(vulkan_child, "test_engine_ops")
    # the portable mode's cases in that module are the cpu backend's: the only skips allowed
    other_skips = [(name, why) for name, why in got["skipped"] if "the portable mode is the cpu backend's" not in why]
    assert len(got["passed"]) > 40 and not other_skips, (other_skips, vulkan_child.output)


@needs_lavapipe
def test_every_recipe_on_vulkan_near_the_cpu_golden_repeatable_and_on_its_own_golden(vulkan_child):
    """Each golden config (lora over q4_k and q8_0 included): 16 losses within 1e-5 relative of
    the cpu golden, the same bits twice, and bit for bit goldens/vulkan-<device>/ where recorded
    for this device."""
    got = outcome(vulkan_child, "test_backends")
    assert len(got["passed"]) >= 7, vulkan_child.output
    # a golden of this device that is missing is a skip naming the file; any other skip is a failure
    assert all("no golden" in why.lower() for _, why in got["skipped"]), got["skipped"]


@needs_lavapipe
def test_the_vulkan_child_ran_only_what_it_was_given(vulkan_child):
    """The selection above reached the modules it names, and no other."""
    assert set(vulkan_child.modules) == {Path(f).stem for f in CHILD_FILES}, vulkan_child.output


@needs_lavapipe
def test_packed_rows_on_vulkan_give_the_unpacked_loss_and_gradients(vulkan_child):
    """tests/test_packing.py's vulkan cases: llama, gpt2 and lora over gemma3, the packed step's
    loss and every gradient within 1e-6 of the unpacked step's over the same examples."""
    got = outcome(vulkan_child, "test_packing")
    assert len(got["passed"]) == 3 and not got["skipped"], (got["skipped"], vulkan_child.output)


@needs_lavapipe
def test_dropout_on_vulkan_is_the_numpy_stream(vulkan_child):
    """tests/test_dropout.py's vulkan cases: the host-fed masks equal the numpy stream bit for bit,
    evaluation's bits are the model's without dropout, and two runs repeat."""
    got = outcome(vulkan_child, "test_dropout")
    assert len(got["passed"]) >= 3 and not got["skipped"], (got["skipped"], vulkan_child.output)


# --- runs without the packages: the build's staged edit and the backend names ----------------
def test_the_layer_settings_edit_applies_once_to_the_pinned_ggml_vulkan():
    build = native_build()
    text = (build.ggml_source() / "src" / "ggml-vulkan" / "ggml-vulkan.cpp").read_text()
    edited = build.vulkan_instance_source(text)
    assert "LayerSettingEXT" in text and "LayerSettingEXT" not in edited
    assert "layer_setting_info" not in edited
    assert edited.count("toyharness: no layer settings") == 1
    # the block was 12 lines (the flag, the settings vector, its create-info, the instance create-info); 1 replaces it
    assert len(edited.splitlines()) == len(text.splitlines()) - 11
    with pytest.raises(build.BuildError, match="found 0 times"):
        build.vulkan_instance_source("int main(void) { return 0; }\n")


def test_metal_on_linux_is_one_line_saying_it_needs_macos():
    proc = subprocess.run([sys.executable, "-m", "toyharness.cli", "run", "gpt2", "--backend", "metal", "--steps", "1"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    if sys.platform == "darwin":
        pytest.skip("this is macOS")
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "metal backend needs macOS" in lines[0], proc.stderr
