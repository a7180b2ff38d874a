"""The portable math (native/portable_math.c, native/portable_quant.c) gives the same bits on every
CPU: its self-test (native/portable_selftest.c: exp, log, sin, cos, silu, dot products and sums
of every tail length, a matrix product, a softmax row, random blocks of every frozen type
dequantized) built at several optimisation and ISA levels for this
CPU, and cross-compiled for aarch64 and run under qemu-user, must print
tests/data/portable_selftest.txt exactly. Where no C compiler, cross compiler or qemu is found,
the test skips, saying which (Debian: apt-get install gcc qemu-user gcc-aarch64-linux-gnu;
`nox -s portable-cross` runs these)."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCES = [REPO / "native" / name for name in ("portable_selftest.c", "portable_math.c", "portable_quant.c")]
EXPECTED = (REPO / "tests" / "data" / "portable_selftest.txt").read_text()
# what CMakeLists.txt gives the portable kernels: no contraction, no fast-math
PORTABLE_FLAGS = ["-ffp-contract=off", "-fno-fast-math"]


def build_and_run(cc: str, flags: list[str], out: Path, runner: list[str] = ()) -> str:
    subprocess.run([cc, *flags, *PORTABLE_FLAGS, *map(str, SOURCES), "-o", str(out)], check=True,
                   capture_output=True, text=True)
    return subprocess.run([*runner, str(out)], check=True, capture_output=True, text=True, timeout=120).stdout


def first_difference(got: str) -> str:
    for want, line in zip(EXPECTED.splitlines(), got.splitlines()):
        if want != line:
            return f"expected `{want}`, got `{line}`"
    return f"{len(got.splitlines())} lines, expected {len(EXPECTED.splitlines())}"


X86_LEVELS = [["-O0"], ["-O3", "-march=x86-64"], ["-O3", "-mavx2", "-mfma"], ["-O3", "-march=native"]]


@pytest.mark.parametrize("flags", X86_LEVELS if platform.machine() == "x86_64" else [["-O0"], ["-O3"]],
                         ids=" ".join)
def test_this_cpu_prints_the_expected_bits(flags, tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc or gcc) on PATH")
    got = build_and_run(cc, flags, tmp_path / "selftest")
    assert got == EXPECTED, first_difference(got)


def test_contraction_would_change_the_bits(tmp_path):
    """The check has teeth: letting the compiler fuse multiply-adds (its default) changes bits."""
    cc = shutil.which("gcc")
    if cc is None or platform.machine() != "x86_64":
        pytest.skip("needs gcc on x86-64 (FMA through -mfma)")
    out = tmp_path / "fused"
    subprocess.run([cc, "-O2", "-mfma", "-ffp-contract=fast", *map(str, SOURCES), "-o", str(out)], check=True)
    assert subprocess.run([str(out)], check=True, capture_output=True, text=True).stdout != EXPECTED


@pytest.mark.parametrize("flags", [["-O0"], ["-O3"], ["-O3", "-mcpu=neoverse-n1"]], ids=" ".join)
def test_aarch64_under_qemu_prints_the_expected_bits(flags, tmp_path):
    cross, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if cross is None or qemu is None:
        missing = [n for n, p in (("aarch64-linux-gnu-gcc", cross), ("qemu-aarch64", qemu)) if p is None]
        pytest.skip(f"{' and '.join(missing)} not found (apt-get install gcc-aarch64-linux-gnu qemu-user)")
    got = build_and_run(cross, [*flags, "-static"], tmp_path / "selftest-aarch64", runner=[qemu])
    assert got == EXPECTED, first_difference(got)
