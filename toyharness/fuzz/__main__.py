"""`python -m toyharness.fuzz`: a seeded fuzz campaign over every registered reader (or some),
with the per-reader table; failing inputs are kept (and with --corpus, added for replay).
Exit 1 if any input crashed, hung, allocated by a hostile number, or raised another error type.

`--atheris READER`: coverage-guided fuzzing of one reader with atheris (libFuzzer), where it is
installed (`pip install -e .[fuzz]`); our structure-aware mutators feed it as custom mutators."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .harness import copy_to_corpus, replay_corpus, run_campaign, table
from .readers import READERS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m toyharness.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("readers", nargs="*", help=f"default: all ({', '.join(READERS)})")
    p.add_argument("--cases", type=int, default=1000, help="cases per reader (default 1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=int, default=0, help="first case index (to shard a campaign)")
    p.add_argument("--time-limit", type=float, default=10.0, help="seconds per case before it counts as a hang")
    p.add_argument("--keep", default="fuzz-failures", help="folder for failing inputs (default ./fuzz-failures)")
    p.add_argument("--corpus", help="also copy failing inputs here (e.g. tests/fuzz_corpus) and replay it first")
    p.add_argument("--atheris", metavar="READER", help="coverage-guided fuzzing of READER with atheris instead")
    p.add_argument("--runs", type=int, default=100000, help="with --atheris: inputs to try (default 100000)")
    args = p.parse_args(argv)

    if args.atheris:
        from .coverage_guided import fuzz_with_atheris

        return fuzz_with_atheris(args.atheris, args.runs, args.seed, Path(args.keep))
    failed = 0
    if args.corpus and Path(args.corpus).is_dir():
        replayed = replay_corpus(Path(args.corpus), args.time_limit)
        print(f"corpus {args.corpus}: {sum(s.tried for s in replayed.values())} inputs replayed")
        print(table(replayed))
        failed += sum(len(s.failures) for s in replayed.values())
    stats = run_campaign(args.readers or None, args.cases, args.seed, args.start, args.time_limit, Path(args.keep))
    print(table(stats))
    for s in stats.values():
        for o in s.failures[:20]:
            print(f"FAIL {o.reader} case {o.index}: {o.kind}: {o.message[:300]}  [{o.input}]")
        if s.messages:
            print(f"{s.reader}: the {len(s.messages)} distinct error messages, most frequent first:")
            for msg, n in s.messages.most_common():
                print(f"  {n:6d}  {msg[:160]}")
    if args.corpus:
        for path in copy_to_corpus(stats, Path(args.corpus)):
            print(f"added {path}")
    failed += sum(len(s.failures) for s in stats.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
