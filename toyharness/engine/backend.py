"""One engine service per backend per process: the ggml backend handle and its thread count."""

from __future__ import annotations

import os
import platform
import re
from typing import TYPE_CHECKING

from .._ffi import available_native_backends, blas, ffi, lib
from ..errors import BackendError
from ..switches import switch
from .loop_controls import TrainingLoop
from .precision import PRECISIONS

if TYPE_CHECKING:
    from .program import Program

KNOWN_BACKENDS = ("cpu", "cuda", "vulkan", "metal")
PORTABLE_FINGERPRINT = "cpu-portable"   # the same bits on every CPU (Engine.set_portable)
_SERVICES: dict[str, Engine] = {}
# The class Engine.program builds, registered by engine/program.py when it is imported (the engine
# package imports it): Program takes its Engine, so the engine names it without importing it back.
_program_class: type[Program] | None = None


def register_program_class(cls: type[Program]) -> None:
    global _program_class
    _program_class = cls


def default_threads() -> int:
    """Free cores: more threads than cores makes ggml's spinning barriers 10-1000x slower."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS
        return max(1, os.cpu_count() or 1)


class Engine:
    """A ggml backend. Get it with `get_engine`; build programs with `engine.program()`."""

    def __init__(self, backend: str, threads: int):
        self.backend = backend
        if backend == "cpu":
            handle = lib.ggml_backend_cpu_init()
        else:
            handle = lib.ggml_backend_init_by_name(backend.upper().encode() + (b"" if backend == "metal" else b"0"),
                                                   ffi.NULL)
        if handle == ffi.NULL:
            raise BackendError(f"backend {backend!r} failed to initialise (no device?)")
        self.handle = handle
        self.buffer_type = lib.ggml_backend_get_default_buffer_type(handle)
        self.threads = 0
        self.set_threads(threads)
        self.portable = False
        self.precision = "fp32"
        # accumulation and clipping of the Trainers of programs made from now on (set_training_loop)
        self.training_loop = TrainingLoop()
        # While a memory plan is made (toyharness/engine/memory_plan.py), programs made on this engine
        # record what they would allocate instead of allocating it.
        self.planner = None

    def set_portable(self, portable: bool) -> None:
        """The cpu backend's portable golden mode, for programs made from now on: every node is
        computed by native/portable_kernels.c, the same float32 operations on every CPU (no
        OpenBLAS, no SIMD-width-dependent sums, our own exp/log/sin/cos). Fingerprint `cpu-portable`."""
        if portable and not self.is_cpu:
            raise BackendError(f"the portable mode is for the cpu backend, not {self.backend}")
        self.portable = bool(portable)

    def set_training_loop(self, accumulate: int = 1, grad_clip: float = 0.0, devices: int = 1) -> None:
        """The training loop's controls for the Trainers of programs made from now on (Options'
        `accumulate`, `grad_clip` and `devices`; engine/loop_controls.py). A run sets them and puts
        the defaults back when it ends: this engine is the process's."""
        self.training_loop = TrainingLoop(accumulate, grad_clip, devices)

    def set_precision(self, precision: str) -> None:
        """The precision of the matrix products of programs made from now on (Options.precision;
        check_precision says which backend takes which)."""
        check_precision(self.backend, precision)
        self.precision = precision

    @property
    def is_cpu(self) -> bool:
        return self.backend == "cpu"

    def set_threads(self, threads: int) -> None:
        if threads < 1:
            raise BackendError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        if self.is_cpu:
            lib.ggml_backend_cpu_set_n_threads(self.handle, threads)

    def program(self, capacity: int = 1 << 16) -> Program:
        if _program_class is None:
            raise RuntimeError("no Program class is registered: import toyharness.engine, not its backend alone")
        return _program_class(self, capacity=capacity)

    def fingerprint(self) -> str:
        """What changes float results on this backend: for cpu, the SIMD level of the build and
        the OpenBLAS kernel that computes the matrix products ("-openblas-<core>", which also
        means native/cpu_kernels.c's stand-ins are on; none: ggml's own kernels only); in the
        portable mode nothing does: `cpu-portable`."""
        if self.is_cpu and self.portable:
            return PORTABLE_FINGERPRINT
        return self.fast_fingerprint()

    def fast_fingerprint(self) -> str:
        """The fingerprint of this build's fast path, whatever the mode."""
        if self.is_cpu:
            return f"cpu-{build_simd()}" + (f"-{blas.tag()}" if blas is not None else "")
        if self.backend == "cuda":
            return f"cuda-{_cuda_arch_tag()}"
        if self.backend == "vulkan":
            return f"vulkan-{_device_slug(self.device_description())}"
        return self.backend

    def description(self) -> str:
        return ffi.string(lib.ggml_backend_name(self.handle)).decode()

    def device_description(self) -> str:
        """The device's own name (for vulkan the driver's: "llvmpipe (LLVM 15.0.6, 256 bits)",
        "NVIDIA H100 80GB HBM3")."""
        return ffi.string(lib.ggml_backend_dev_description(lib.ggml_backend_get_device(self.handle))).decode()


def build_simd() -> str:
    """The SIMD level ggml-cpu was compiled for (ggml's `ggml_cpu_has_*` answer for the build, not
    for the CPU: an AVX2 build says avx2 on an AVX-512 machine)."""
    for level, has in (("avx512", lib.ggml_cpu_has_avx512), ("avx2", lib.ggml_cpu_has_avx2),
                       ("avx", lib.ggml_cpu_has_avx), ("sve", lib.ggml_cpu_has_sve), ("neon", lib.ggml_cpu_has_neon)):
        if has():
            return level
    return "scalar"


def blas_kernel() -> str:
    """The BLAS that computes the cpu fast path's f32 products, as the header of `bench` names it:
    OpenBLAS's kernel (its `get_corename`), and OPENBLAS_CORETYPE when set (that forces the kernel,
    e.g. Haswell on an AVX-512 CPU); "none" where scipy-openblas32 is not installed."""
    if blas is None:
        return "none (ggml's own kernels)"
    forced = os.environ.get("OPENBLAS_CORETYPE")
    return f"OpenBLAS {blas.corename} (scipy-openblas32 {blas.version}" + (
        f", OPENBLAS_CORETYPE={forced})" if forced else ")")


def _device_slug(text: str) -> str:
    """A device description as a fingerprint part: lower case, runs of other characters as one '-'
    (llvmpipe's names its LLVM version and vector width, both of which change float results)."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def check_precision(backend: str, precision: str) -> None:
    """fp32 on every backend; tf32 and bf16 on cuda with toyharness's kernels
    (native/cuda/th-precision.cu). Anything else is refused with the reason, before a program is built."""
    from .._ffi import cuda_kernels_built

    if precision not in PRECISIONS:
        raise BackendError(f"precision {precision!r} is not known; allowed: {', '.join(PRECISIONS)}")
    if precision == "fp32":
        return
    if backend != "cuda":
        raise BackendError(f"precision {precision} is for the cuda backend: the {backend} backend computes every "
                           "matrix product in fp32 (its kernels have no TF32 or bf16 path); use precision=fp32")
    if not cuda_kernels_built():
        raise BackendError(f"precision {precision}: this ggml-cuda was built without toyharness's precision "
                           "dispatch (native/cuda/th-precision.cu): reinstall (pip install -e .)")
    if precision == "tf32" and os.environ.get("NVIDIA_TF32_OVERRIDE") == "0":
        raise BackendError("precision tf32: NVIDIA_TF32_OVERRIDE=0 in the environment turns TF32 off in cuBLAS; "
                           "unset it")


def _cuda_arch_tag() -> str:
    arch = switch("TOYHARNESS_CUDA_ARCH")
    return f"sm{arch}"


def get_engine(backend: str = "cpu", threads: int | None = None) -> Engine:
    """The process-wide service for `backend` (created on first use)."""
    backend = backend.lower()
    if backend not in KNOWN_BACKENDS:
        raise BackendError(f"unknown backend {backend!r}; allowed: {', '.join(KNOWN_BACKENDS)}")
    if backend == "metal" and platform.system() != "Darwin":
        raise BackendError(f"the metal backend needs macOS (Apple's Metal API); this is {platform.system()}")
    if backend not in available_native_backends():
        raise BackendError(f"backend {backend!r} is not in this build (built: "
                           f"{', '.join(available_native_backends())}); rebuild with "
                           f"TOYHARNESS_BACKENDS=cpu,{backend} pip install -e .")
    eng = _SERVICES.get(backend)
    if eng is None:
        eng = _SERVICES[backend] = Engine(backend, threads or default_threads())
    elif threads is not None and threads != eng.threads:
        eng.set_threads(threads)
    return eng
