"""Hostile input: every reader a user's file reaches, fed seeded mutations of valid files
(toyharness/fuzz). Each input must end in a clean read or the project's own one-line error naming
the file; never a crash, hang, other exception type, or an allocation sized by a hostile number.
A few thousand cases here; `nox -s fuzz` runs 100k and atheris."""

import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest

from toyharness.arrays import load_npy, load_npz
from toyharness.engine import GGUFFile, write_gguf
from toyharness.engine.gguf_layout import walk
from toyharness.errors import GGUFError, InputError
from toyharness.fuzz import READERS, replay_corpus, run_campaign
from toyharness.fuzz.harness import check_one, make_case, table
from toyharness.fuzz.mutate import npy_with_header

CORPUS = Path(__file__).parent / "fuzz_corpus"
CASES_PER_READER = 250       # 12 readers: ~3000 cases


def test_every_reader_survives_seeded_mutations(tmp_path, capsys):
    stats = run_campaign(cases=CASES_PER_READER, seed=0, keep_failures=tmp_path / "failures")
    with capsys.disabled():
        print("\n" + table(stats))
    failures = [f"{o.reader} case {o.index}: {o.kind}: {o.message[:200]} [{o.input}]"
                for s in stats.values() for o in s.failures]
    assert not failures, "\n".join(failures)
    for s in stats.values():
        assert s.tried == CASES_PER_READER
        assert s.ok >= 1, f"{s.reader}: not even the unmutated seeds read cleanly"
        assert s.errors >= 1 and len(s.messages) >= 2, f"{s.reader}: the mutations never produce an error"


def test_the_corpus_of_inputs_that_once_failed_replays_clean():
    stats = replay_corpus(CORPUS)
    assert sum(s.tried for s in stats.values()) >= 10, "the committed corpus is missing"
    failures = [f"{o.reader}: {o.kind}: {o.message[:200]}" for s in stats.values() for o in s.failures]
    assert not failures, "\n".join(failures)


def test_the_harness_catches_what_it_must(tmp_path):
    """The checks can fail: a reader that raises another type, hangs, allocates by a number, or
    raises a project error without the file's name is caught, each as its own kind."""
    from toyharness.fuzz.readers import Reader

    case = tmp_path / "case.bin"
    case.write_bytes(b"128")

    def wrong_type(path):
        raise KeyError("x")

    def hangs(path):
        while True:
            pass

    def allocates(path):
        return np.empty(int(path.read_text()) << 20, np.uint8)     # 128 MiB from a 3-byte file

    def unnamed(path):
        raise InputError("something is wrong")

    def named(path):
        raise InputError(f"{path}: something is wrong")

    kinds = {fn.__name__: check_one(Reader(fn.__name__, fn, ".bin"), case, 0.5).kind
             for fn in (wrong_type, hangs, allocates, unnamed, named)}
    assert kinds == {"wrong_type": "exception", "hangs": "hang", "allocates": "alloc", "unnamed": "bad_error",
                     "named": "error"}


def test_a_crashing_reader_is_caught_and_its_input_kept(tmp_path):
    """An abort (as inside ggml) kills only the worker: the case is recorded as a crash, its bytes
    kept, and the campaign goes on with the next case."""
    extra = tmp_path / "aborting_reader.py"
    extra.write_text(ABORTING_READER)
    stats = run_campaign(["aborts_on_odd"], cases=16, keep_failures=tmp_path / "kept", reader_files=[extra])
    s = stats["aborts_on_odd"]
    assert s.tried == 16 and s.ok + s.errors + len(s.failures) == 16
    kinds = {o.kind for o in s.failures}
    assert kinds == {"crash", "exception"} and s.ok, "the seeded bytes should give every kind of first byte"
    for o in s.failures:         # the input kept is the one that failed, not a later case's
        first = Path(o.input).read_bytes()[0]
        if o.kind == "crash":
            assert "SIGABRT" in o.message and first % 2 == 1
        else:
            assert o.message.startswith("KeyError") and first % 4 == 2


ABORTING_READER = """
import os
from toyharness.fuzz.readers import reader

@reader("aborts_on_odd", ".bin", mutate=lambda data, rng: bytes([int(rng.integers(256))]) + data[1:])
def _aborts(path):
    first = path.read_bytes()[0]
    if first % 2:
        os.abort()
    if first % 4 == 2:
        raise KeyError(first)

_aborts.seeds(lambda workdir: [b"\\x00abc"])
"""


def test_cases_are_reproducible_from_reader_seed_and_index(tmp_path):
    r = READERS["gguf"]
    seeds = r.make_seeds(tmp_path)
    a = [make_case(r, seeds, 3, i) for i in range(20)]
    b = [make_case(r, seeds, 3, i) for i in range(20)]
    assert a == b
    assert a[:len(seeds)] == seeds and all(x not in seeds for x in a[len(seeds) + 1:len(seeds) + 4])


# --- the validating readers, each against the bad input that makes it speak ----------------------
def _gguf_with_array(tmp_path, count: int) -> Path:
    good = write_gguf(tmp_path / "a.gguf", "llama", {"w": np.zeros(4, np.float32)}, {"x.nums": [1, 2, 3]})
    data = bytearray(good.read_bytes())
    parts = [p for p in walk(bytes(data)).parts if p.kind == "array_count"]
    struct.pack_into("<Q", data, parts[0].start, count)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    return bad


def test_a_gguf_array_count_past_the_file_is_refused_before_gguf_py_loops_over_it(tmp_path):
    # gguf-py's reader loops over the count without moving once past the end: a hang.
    bad = _gguf_with_array(tmp_path, 2**40)
    with pytest.raises(GGUFError, match=r"bad.gguf: truncated or corrupt: metadata 'x.nums' is an array of "
                                        r"1099511627776 elements"):
        GGUFFile(bad)


def test_gguf_tensor_data_overlapping_or_outside_the_file_is_refused(tmp_path):
    good = write_gguf(tmp_path / "t.gguf", "llama", {"a": np.zeros(8, np.float32), "b": np.ones(8, np.float32)})
    data = bytearray(good.read_bytes())
    offsets = [p for p in walk(bytes(data)).parts if p.kind == "tensor_offset"]
    overlap = bytearray(data)
    overlap[offsets[1].start:offsets[1].start + 8] = struct.pack("<Q", 0)
    (tmp_path / "overlap.gguf").write_bytes(bytes(overlap))
    with pytest.raises(GGUFError, match="overlap.gguf: tensor '[ab]': its data overlaps tensor '[ab]'"):
        GGUFFile(tmp_path / "overlap.gguf")
    outside = bytearray(data)
    outside[offsets[1].start:offsets[1].start + 8] = struct.pack("<Q", 2**20)
    (tmp_path / "outside.gguf").write_bytes(bytes(outside))
    with pytest.raises(GGUFError, match=r"outside.gguf: truncated: tensor 'b' needs bytes \[\d+, \d+\)"):
        GGUFFile(tmp_path / "outside.gguf")


def test_gguf_metadata_that_is_not_utf8_is_named(tmp_path):
    good = write_gguf(tmp_path / "u.gguf", "llama", {"w": np.zeros(4, np.float32)}, {"general.name": "abc"})
    bad = tmp_path / "u8.gguf"
    bad.write_bytes(good.read_bytes().replace(b"abc", b"\xc0\xafc"))
    with GGUFFile(bad) as f, pytest.raises(GGUFError, match="u8.gguf: metadata 'general.name' is not UTF-8"):
        f.field("general.name")


def test_npy_header_declaring_a_huge_array_is_refused_before_numpy_allocates(tmp_path):
    path = tmp_path / "huge.npy"
    path.write_bytes(npy_with_header("{'descr': '<u2', 'fortran_order': False, 'shape': (1099511627776,), }",
                                     b"\0" * 64))
    with pytest.raises(InputError, match=r"huge.npy: the header declares \(1099511627776,\) of uint16 "
                                         r"\(2199023255552 bytes\) but 64 bytes follow it"):
        load_npy(path)


def test_npz_member_claiming_more_than_deflate_can_give_is_refused(tmp_path):
    import io

    buf = io.BytesIO()
    np.save(buf, np.zeros(10, np.float32))
    path = tmp_path / "z.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("images.npy", buf.getvalue())
    raw = bytearray(path.read_bytes())
    # the central directory's uncompressed size (offset 24 in its record) claims 1 GB
    cd = raw.rindex(b"PK\x01\x02")
    struct.pack_into("<I", raw, cd + 24, 10**9)
    path.write_bytes(bytes(raw))
    with pytest.raises(InputError, match="z.npz member 'images.npy': claims 1000000000 bytes from"):
        load_npz(path)


def test_toml_value_errors_name_the_config_file(tmp_path):
    from toyharness.discovery import get_recipe
    from toyharness.runner import resolve_options

    _, obj = get_recipe("gpt2")
    for text, message in [("t_seq = inf\n", "option 't_seq': inf is not a valid int"),
                          ("t_batch = 9223372036854775807\n", "option 't_batch': 9223372036854775807 is out of range"),
                          ("t_seq = -4\n", "option 't_seq': must be > 0, got -4"),
                          ("data = [1]\n", "option 'data': [1] is not a valid str"),
                          ("lr = 1\n\xff = 2\n", "not valid TOML")]:
        path = tmp_path / "c.toml"
        path.write_bytes(text.encode("latin1"))
        with pytest.raises(InputError) as exc:
            resolve_options(obj, str(path), [], {})
        assert f"config file {path}: " in str(exc.value) and message in str(exc.value), str(exc.value)


def test_structural_gguf_mutations_of_a_gguf_with_no_fields_fall_back_to_bytes():
    """atheris fed the mutator a GGUF with no metadata and no tensors: picking a type field from none
    raised inside the fuzzer (ValueError: high <= 0) and ended its campaign."""
    from toyharness.fuzz import mutate as m

    empty = b"GGUF" + struct.pack("<IQQ", 3, 0, 0) + bytes(8)     # padded to the alignment, 32
    layout = walk(empty)
    rng = np.random.default_rng(0)
    for mutation in (m.gguf_truncate_at_boundary, m.gguf_hostile_number, m.gguf_wrong_type, m.gguf_tensor_data,
                     m.gguf_bad_utf8):
        for _ in range(20):
            assert isinstance(mutation(empty, rng, layout), bytes)


def test_the_npy_mutator_survives_a_header_with_negative_dimensions():
    """atheris made a .npy whose header declares shape (-1, 4): the mutator built its hostile array
    from that shape and raised inside the fuzzer (negative dimensions)."""
    from toyharness.fuzz.mutate import mutate_npy

    header = "{'descr': '<u2', 'fortran_order': False, 'shape': (-1, 4), }"
    header += " " * (63 - len(header)) + "\n"
    npy = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + bytes(32)
    for seed in range(60):      # the header-derived branch is one in five
        assert isinstance(mutate_npy(npy, np.random.default_rng(seed)), bytes)


def test_an_empty_npy_whose_other_dimension_no_array_can_span_is_refused(tmp_path):
    """Found by atheris: shape (0, 10**25) declares no bytes, so the size check passed, and numpy's
    reshape raised 'Maximum allowed dimension exceeded'."""
    header = "{'descr': '<f2', 'fortran_order': False, 'shape': (0, 11529215046021504606846976), }"
    header += " " * (127 - 10 - len(header)) + "\n"
    path = tmp_path / "t.npy"
    path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
    with pytest.raises(InputError, match=r"t\.npy: shape \(0, 11529215046021504606846976\) is too large for any array"):
        load_npy(path, "tokens")


# --- the graph API (toyharness/fuzz/graphs.py) ---------------------------------------------------
GRAPH_CASES = 500      # `nox -s fuzz` runs 10,000


def test_random_graphs_train_a_step_or_raise_one_line_naming_the_line(capsys):
    """Random graphs of the public Tensor ops (views, several consumers, wrong arguments), half in
    the portable mode: each trains a step or raises the project's one-line error (a ShapeError
    ending with the line that made the node); none aborts the process."""
    from toyharness.fuzz.graphs import run_graph_campaign, summary

    stats = run_graph_campaign(GRAPH_CASES, seed=0)
    with capsys.disabled():
        print("\n" + summary(stats))
    assert stats.tried == GRAPH_CASES
    assert not stats.failures, summary(stats)
    assert stats.ok >= GRAPH_CASES // 4, "too few random graphs train: the fuzz target builds mostly errors"
    assert stats.errors >= GRAPH_CASES // 10 and len(stats.messages) >= 5


def test_the_graph_harness_records_a_crash_and_continues(monkeypatch):
    """A worker that aborts on a case: that case is a crash, the next worker runs the rest."""
    import subprocess
    import sys

    from toyharness.fuzz import graphs

    script = ("import json, os, sys\n"
              "start, stop = int(sys.argv[1]), int(sys.argv[2])\n"
              "for i in range(start, stop):\n"
              "    print(f'start {i}', flush=True)\n"
              "    if i == 2: os.abort()\n"
              "    print(json.dumps({'index': i, 'kind': 'ok', 'message': ''}), flush=True)\n")

    def spawn(seed, start, stop):
        return subprocess.Popen([sys.executable, "-c", script, str(start), str(stop)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    monkeypatch.setattr(graphs, "_spawn", spawn)
    stats = graphs.run_graph_campaign(5, seed=0)
    assert stats.tried == 5 and stats.ok == 4
    assert [(i, kind) for i, kind, _ in stats.failures] == [(2, "crash")]
