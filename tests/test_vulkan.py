"""The vulkan backend in the default suite, on Mesa's lavapipe (llvmpipe, a Vulkan device on the
CPU): a ggml build with vulkan is made (cached in ~/.cache/toyharness like every build) into a
folder of its own, and the op checks (tests/test_engine_ops.py) and the golden checks
(tests/test_backends.py -m vulkan) run against it in a child pytest. Where Debian's packages are
absent, these skip and name the apt-get line. `nox -s tests-vulkan` runs the same in-process.

ggml skips CPU devices unless GGML_VK_VISIBLE_DEVICES names them: lavapipe is device 0 here."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
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


def child_pytest(native: Path, args: list[str], extra_env: dict[str, str]) -> tuple[int, str]:
    env = {**os.environ, "TOYHARNESS_NATIVE_DIR": str(native), **extra_env}
    env.setdefault("GGML_VK_VISIBLE_DEVICES", "0")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    return proc.returncode, proc.stdout + proc.stderr


def counts(output: str) -> dict[str, int]:
    """pytest's summary line as {"passed": n, "failed": n, "skipped": n, ...}."""
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", output)}


@needs_lavapipe
def test_every_op_and_block_on_vulkan_against_float64_numpy(vulkan_native):
    rc, out = child_pytest(vulkan_native, ["tests/test_engine_ops.py"], {"TOYHARNESS_TEST_BACKEND": "vulkan"})
    print(out[-3000:])
    got = counts(out)
    # the portable mode's cases in that module are the cpu backend's: the only skips allowed
    other_skips = [line for line in out.splitlines()
                   if line.startswith("SKIPPED") and "the portable mode is the cpu backend's" not in line]
    assert rc == 0 and got.get("passed", 0) > 40 and not other_skips, out[-6000:]


@needs_lavapipe
def test_graphs_lowered_for_metal_on_vulkan(vulkan_native):
    """tests/test_metal_lowering.py on vulkan: the lowered graphs within 1e-6 of vulkan's goldens."""
    rc, out = child_pytest(vulkan_native, ["tests/test_metal_lowering.py", "-s"], {"TOYHARNESS_TEST_BACKEND": "vulkan"})
    print(out[-3000:])
    got = counts(out)
    assert rc == 0 and got.get("passed", 0) >= 20 and not got.get("skipped"), out[-6000:]


@needs_lavapipe
def test_every_recipe_on_vulkan_near_the_cpu_golden_repeatable_and_on_its_own_golden(vulkan_native):
    """Each golden config (lora over q4_k and q8_0 included): 16 losses within 1e-5 relative of
    the cpu golden, the same bits twice, and bit for bit goldens/vulkan-<device>/ where recorded
    for this device."""
    rc, out = child_pytest(vulkan_native, ["tests/test_backends.py", "-m", "vulkan", "-s"], {})
    print(out[-4000:])
    got = counts(out)
    assert rc == 0 and got.get("passed", 0) >= 7, out[-6000:]
    # a golden of this device that is missing is a skip naming the file; any other skip is a failure
    skips = re.findall(r"SKIPPED \[\d+\] [^\n]*", out)
    assert all("No such file" in s or "no golden" in s.lower() for s in skips), skips


@needs_lavapipe
def test_frozen_products_and_lora_over_every_frozen_type_on_vulkan(vulkan_native):
    """tests/test_quant.py -m vulkan: each frozen type's product and input gradient against
    gguf-py's dequantization, and lora over a base of each quantized type repeating its bits
    and within 1e-4 of cpu."""
    rc, out = child_pytest(vulkan_native, ["tests/test_quant.py", "-m", "vulkan"], {})
    print(out[-3000:])
    got = counts(out)
    assert rc == 0 and got.get("passed", 0) >= 21 and not got.get("skipped"), out[-6000:]


@needs_lavapipe
def test_packed_rows_on_vulkan_give_the_unpacked_loss_and_gradients(vulkan_native):
    """tests/test_packing.py -m vulkan: llama, gpt2 and lora over gemma3, the packed step's loss and
    every gradient within 1e-6 of the unpacked step's over the same examples."""
    rc, out = child_pytest(vulkan_native, ["tests/test_packing.py", "-m", "vulkan"], {})
    print(out[-3000:])
    got = counts(out)
    assert rc == 0 and got.get("passed", 0) == 3 and not got.get("skipped"), out[-6000:]


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
