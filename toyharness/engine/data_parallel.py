"""Data parallel: a step's micro-batches spread over N processes, with the bits of one process
accumulating them all (engine/loop_controls.py, `accumulate`).

A step has N x K micro-batches (K: the run's `accumulate`, 1 by default), computed in K rounds:
in round k process r computes micro-batch k N + r. After each round every process's gradients
(the sums its loss counts) are gathered to every process, and each adds them to its running sum
as accumulation does: the first, then each next one added, in micro-batch order, in float32 (the
same one rounding per element as accumulation's ADD). The step's last micro-batch's gradients
stay apart: every process then runs the Trainer's gb_apply, the controls (sum, 1/count, clip) and
AdamW steps of accumulation's last graph, on the same values, so every process holds the same
parameters after each step.

The cost: each process receives every other's gradients (N - 1 copies of the trainable
parameters' size a round): small for LoRA's adapters, the whole model for full training. The
option ``gradient_reduce = "allreduce"`` instead has each process add its own K micro-batches'
gradients and MPI sum those N sums once a step (Allreduce: about 2 copies a step whatever N and
K), and steps on that sum: the same arithmetic in another order of adding, so the bits may differ
from accumulation's (within float32 rounding).

The processes talk through MPI (mpi4py, with the MPICH that the `mpich` wheel installs), started by
its launcher: ``mpiexec -n N toyharness run RECIPE --set devices=N [--set accumulate=K]``, by hand
or by the run itself (toyharness/launcher.py).
"""

from __future__ import annotations

import sys
from typing import Protocol

import numpy as np

from ..errors import InputError


class Collective(Protocol):
    """The processes of a data-parallel run, as a Trainer uses them."""

    rank: int       # this process's micro-batch of each round
    size: int       # the processes (micro-batches a round)

    def allgather(self, values: np.ndarray) -> np.ndarray:
        """Every process's 1-D `values` (all of one length and dtype), by rank: (size, n)."""

    def allreduce_sum(self, values: np.ndarray) -> np.ndarray:
        """The element-wise sum of every process's 1-D `values`, in the collective's own order."""


def sum_in_order(gathered: np.ndarray, running: np.ndarray | None = None,
                 keep_last: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """One round of micro-batches' gradients (size, n) float32, added in order to `running` (the
    earlier rounds' sum; None in the first) as accumulation adds them, each addition g_k + sum, one
    float32 rounding per element. With `keep_last` the round's last micro-batch stays apart:
    (sum of all before it, its gradients); else (the sum of all, None)."""
    if gathered.dtype != np.float32 or gathered.ndim != 2 or len(gathered) < 2:
        raise ValueError(f"sum_in_order: (processes >= 2, n) float32 gradients, got {gathered.dtype} "
                         f"{gathered.shape}")
    added = gathered[:-1] if keep_last else gathered
    if running is None:
        running, added = added[0].copy(), added[1:]
    for g in added:
        np.add(g, running, out=running)
    return running, (gathered[-1] if keep_last else None)


def several_processes() -> bool:
    """Whether this process is one of several that MPI started and connected (mpi4py loaded)."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() and mpi.COMM_WORLD.Get_size() > 1


def end_every_process(code: int) -> None:
    """Where several_processes(), end them all with exit `code` (MPI_Abort): a process that stopped
    alone would leave the others waiting in their next collective. Call it after the one line that
    says why; elsewhere it does nothing."""
    if several_processes():
        sys.stdout.flush()
        sys.stderr.flush()
        sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(code)


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
