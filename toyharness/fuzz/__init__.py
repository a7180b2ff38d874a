"""Fuzzing every reader a user's file reaches (issue 19).

The contract, for every input: the reader returns, or raises the project's own error
(`toyharness.errors.ToyharnessError`) whose one-line message names the file. Never a crash (an
abort inside ggml, a segfault), a hang, another exception type, or an allocation sized by a
hostile number rather than by the file.

- `readers.py` registers the readers: one small function each (read a path; return or raise),
  with the valid seed files its mutations start from.
- `mutate.py` holds the seeded mutators (bytes, and structure-aware for GGUF, .npy/.npz, TOML,
  JSON lines).
- `harness.py` runs cases in a worker process (so an abort or segfault is caught and the input
  kept), each under a time limit and an allocation check, and counts outcomes per reader.
- `graphs.py` fuzzes the graph API instead of a reader: random graphs of engine/tensor.py's ops
  (views, several consumers, wrong arguments), each of which must train a step or raise the
  project's one-line error, never abort (`python -m toyharness.fuzz.graphs`).
- `python -m toyharness.fuzz` runs a campaign and prints the table (the nox session `fuzz`);
  tests/test_fuzz.py runs a few thousand cases and replays tests/fuzz_corpus/.

Adding a reader (for example a tokenizer or JSONL data reader) is one registration in
`readers.py`::

    @reader("jsonl_data", suffix=".jsonl", mutate=mutate_jsonl)
    def _jsonl_data(path: Path) -> None:
        load_jsonl(path)                  # returns, or raises InputError naming the file

    @_jsonl_data.seeds
    def _(workdir: Path) -> list[bytes]:
        return [b'{"text": "hello"}\\n{"text": "world"}\\n']

Every campaign and the default suite then cover it.
"""

from .harness import Outcome, Stats, replay_corpus, run_campaign
from .readers import READERS, Reader, reader

__all__ = ["READERS", "Reader", "reader", "run_campaign", "replay_corpus", "Outcome", "Stats"]
