"""Data parallel: a step's micro-batches computed by as many processes, one each, with the bits of
one process accumulating them (engine/loop_controls.py, `accumulate`).

Each process computes its micro-batch's gradients (the sums its loss counts), all of them are
gathered to every process, and each sums them as accumulation does: the first, then each next one
added to the running sum, in micro-batch order, in float32 (the same one rounding per element as
accumulation's ADD). The step's last micro-batch's gradients stay apart: every process then runs
the Trainer's gb_apply, the controls (sum, 1/count, clip) and AdamW steps of accumulation's last
graph, on the same values, so every process holds the same parameters after each step.

The cost: each process receives every other's gradients (N - 1 copies of the trainable
parameters' size a step): small for LoRA's adapters, the whole model for full training. The
option ``gradient_reduce = "allreduce"`` instead has MPI sum all N micro-batches' gradients
(Allreduce: about 2 copies a step whatever N) and steps on that sum: the same arithmetic in MPI's
order of adding, so the bits may differ from accumulation's (within float32 rounding).

The processes talk through MPI (mpi4py, with the MPICH that the `mpich` wheel installs), started by
its launcher: ``mpiexec -n N toyharness run RECIPE --set devices=N``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..errors import InputError


class Collective(Protocol):
    """The processes of a data-parallel run, as a Trainer uses them."""

    rank: int       # this process's micro-batch of each step
    size: int       # the processes (micro-batches a step)

    def allgather(self, values: np.ndarray) -> np.ndarray:
        """Every process's 1-D `values` (all of one length and dtype), by rank: (size, n)."""

    def allreduce_sum(self, values: np.ndarray) -> np.ndarray:
        """The element-wise sum of every process's 1-D `values`, in the collective's own order."""


def sum_in_order(gathered: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The micro-batches' gradients (size, n) float32, summed in order as accumulation sums them
    but for the last: (g0 + g1 + ... + g[size-2], g[size-1]); each addition is g_k + sum, one
    float32 rounding per element."""
    if gathered.dtype != np.float32 or gathered.ndim != 2 or len(gathered) < 2:
        raise ValueError(f"sum_in_order: (processes >= 2, n) float32 gradients, got {gathered.dtype} "
                         f"{gathered.shape}")
    running = gathered[0].copy()
    for k in range(1, len(gathered) - 1):
        np.add(gathered[k], running, out=running)
    return running, gathered[-1]


class MpiCollective:
    """MPI's COMM_WORLD (mpi4py): the processes `mpiexec -n N` started."""

    def __init__(self) -> None:
        try:
            from mpi4py import MPI
        except ImportError:
            raise InputError('devices > 1 needs MPI: pip install "toyharness[dp]", then start the run with '
                             "mpiexec -n N") from None
        self._comm = MPI.COMM_WORLD
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()

    def allgather(self, values: np.ndarray) -> np.ndarray:
        values = np.ascontiguousarray(values)
        out = np.empty((self.size, values.size), values.dtype)
        self._comm.Allgather(values, out)
        return out

    def allreduce_sum(self, values: np.ndarray) -> np.ndarray:
        from mpi4py import MPI

        values = np.ascontiguousarray(values)
        out = np.empty_like(values)
        self._comm.Allreduce(values, out, op=MPI.SUM)
        return out
