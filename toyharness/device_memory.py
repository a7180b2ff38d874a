"""A process's memory on the GPU as the driver counts it (NVML, the library nvidia-smi reads).

`toyharness bench --backend cuda` reports each side's device memory this way (issue 32: "ours
measured with the driver's numbers, not RSS"): ggml's buffers, our bf16 copies, cuBLAS's
workspaces, the CUDA context, and for PyTorch its caching allocator's reserved blocks; not what an
allocator says it handed out. The workers run side by side on one GPU, so a device-wide figure
(cudaMemGetInfo, nvidia-smi's used memory) would count the others: NVML's per-process figure is
the one that separates them. Neither side gives memory back during its steps (ggml keeps its
buffers, PyTorch's allocator its blocks), so the largest figure sampled after each round of steps
is the process's peak. None where NVML or the process's entry is not found (no NVIDIA driver, or
a sandbox whose process ids the driver does not see).
"""

from __future__ import annotations

import ctypes
import os


class _ProcessInfo(ctypes.Structure):       # nvmlProcessInfo_t (v2 and v3 share this layout)
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


_nvml = None


def _library():
    global _nvml
    if _nvml is None:
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            _nvml = lib if lib.nvmlInit_v2() == 0 else False
        except OSError:
            _nvml = False
    return _nvml or None


def nvidia_gpu_count() -> int:
    """The GPUs the NVIDIA driver lists (NVML), whatever CUDA_VISIBLE_DEVICES says; 0 where it
    cannot be read. No CUDA context is made: asking costs no GPU memory."""
    lib = _library()
    count = ctypes.c_uint(0)
    if lib is None or lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
        return 0
    return int(count.value)


def process_device_mb(pid: int | None = None) -> float | None:
    """MiB that process `pid` (default: this one) holds on all GPUs, as NVML counts it; None where
    it cannot be read."""
    lib = _library()
    if lib is None:
        return None
    pid = os.getpid() if pid is None else pid
    count = ctypes.c_uint(0)
    if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
        return None
    total, found = 0, False
    for index in range(count.value):
        handle = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
            continue
        n = ctypes.c_uint(64)
        infos = (_ProcessInfo * 64)()
        get = getattr(lib, "nvmlDeviceGetComputeRunningProcesses_v3", None)
        get = get or lib.nvmlDeviceGetComputeRunningProcesses_v2
        if get(handle, ctypes.byref(n), infos) != 0:
            continue
        for info in infos[: n.value]:
            if info.pid == pid and info.usedGpuMemory < 2**63:      # NVML_VALUE_NOT_AVAILABLE is ~0
                total += info.usedGpuMemory
                found = True
    return total / 2**20 if found else None


class PeakDeviceMemory:
    """The largest `process_device_mb` of this process over the samples taken (`sample`)."""

    def __init__(self) -> None:
        self.peak_mb: float | None = None

    def sample(self) -> None:
        mb = process_device_mb()
        if mb is not None:
            self.peak_mb = mb if self.peak_mb is None else max(self.peak_mb, mb)
