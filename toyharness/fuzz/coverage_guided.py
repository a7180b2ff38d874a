"""Coverage-guided fuzzing of one reader with atheris (Google's libFuzzer for Python).

atheris instruments the Python code the reader runs (ours, gguf-py's, numpy's Python parts) and
keeps the inputs that reach new branches; its mutations mix libFuzzer's own with ours from
mutate.py (structure-aware for GGUF, .npy/.npz, TOML). Each input gets the same contract check
as the seeded campaign (`harness.check_one`); a violation raises, and libFuzzer keeps the input
as `crash-<sha1>` under the keep folder (an abort inside ggml is caught by libFuzzer itself).
Add a kept input to tests/fuzz_corpus/<reader>/ once fixed.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np


class ContractViolation(Exception):
    """A fuzz input ended in something other than a clean read or the project's own error."""


def fuzz_with_atheris(name: str, runs: int, seed: int, keep: Path) -> int:
    try:
        import atheris
    except ImportError:
        print("atheris is not installed here (pip install -e .[fuzz]); the seeded campaign "
              "(python -m toyharness.fuzz) covers the same readers", file=sys.stderr)
        return 2
    from .harness import check_one
    from .mutate import mutate_bytes
    from .readers import READERS

    reader = READERS[name]
    work = Path(tempfile.mkdtemp(prefix=f"toyharness-atheris-{name}-"))
    seeds = reader.make_seeds(work) if reader.make_seeds else []
    corpus = keep / f"atheris-{name}"
    corpus.mkdir(parents=True, exist_ok=True)
    for i, data in enumerate(seeds):
        (corpus / f"seed{i}{reader.suffix}").write_bytes(data)
    case = work / f"case{reader.suffix}"
    case.write_bytes(seeds[0])
    check_one(reader, case, 60.0)       # imports and the engine, before instrumenting

    def test_one(data: bytes) -> None:
        case.write_bytes(data)
        # Our own timer times each input: ours owns SIGALRM, so libFuzzer's timer (-timeout, and
        # -max_total_time, which it checks from the same alarm) is off; bound a session's wall
        # time from outside (noxfile: `timeout`).
        outcome = check_one(reader, case, 10.0)
        if outcome.failed:
            raise ContractViolation(f"{name}: {outcome.kind}: {outcome.message[:500]}")

    def custom_mutator(data: bytes, max_size: int, mutation_seed: int) -> bytes:
        rng = np.random.default_rng(mutation_seed)
        if rng.random() < 0.5:
            return atheris.Mutate(data, max_size)
        try:
            mutate = reader.mutator(data) if reader.mutate_for_seed else reader.mutate
        except Exception:      # a GGUF too damaged to walk: plain byte mutations
            mutate = mutate_bytes
        return mutate(data, rng)[:max_size]

    atheris.instrument_all()
    args = [sys.argv[0], f"-runs={runs}", f"-seed={seed or 1}", "-timeout=0", "-rss_limit_mb=4096",
            f"-artifact_prefix={keep}/{name}-", "-print_final_stats=1", str(corpus)]
    atheris.Setup(args, test_one, custom_mutator=custom_mutator)
    atheris.Fuzz()      # exits the process: 0 when every run kept the contract
    return 0
