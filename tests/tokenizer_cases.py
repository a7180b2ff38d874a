"""Tricky texts and the two vocabularies whose ids tests/data/tokenizer_agreement.json holds as
llama.cpp gives them (native/llamacpp/th_tokenize, from the pinned archive):

- `smollm2`: tests/data/smollm2-tokenizer.gguf, SmolLM2-135M-Instruct's metadata only (its
  tokenizer: gpt2 model, pre-tokenizer smollm, 49152 tokens; no tensors; Apache-2.0);
- `spm`: a small SentencePiece-style `llama` vocabulary written here (no weights exist for it):
  control tokens, the 256 byte tokens, one user-defined token, and pieces with distinct scores;
- `gemma3`: a small vocabulary laid out as llama.cpp's converter writes Gemma 3's (model `llama`,
  add_space_prefix false, add_bos true, <pad> <eos> <bos> <unk> <mask> at 0-4, the 256 byte tokens,
  <start_of_turn>/<end_of_turn> control, an <unusedN> control token, an image marker user-defined,
  runs of spaces and newlines as pieces): it exercises the rules of Gemma 3's own 262,144-token
  vocabulary, which tests/test_realmodel.py checks against llama.cpp on the real file (too large
  to keep here; fetched by package name);
- llama.cpp's own vocabularies from the pinned archive's models folder (`VOCABS`: phi-3, qwen2,
  qwen35, llama-spm, llama-bpe, gpt-2, gemma-4), fetched once into the cache by native/build.py;
- `PRE_VARIANTS`: one of those with another pre-tokenizer written in (gpt-4o: Phi-4-mini's).

Re-derive the file (the `llamacpp` nox session checks it too):
    python tests/tokenizer_cases.py TOOL/th_tokenize --write
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).parent / "data"
SMOLLM2_VOCAB = DATA / "smollm2-tokenizer.gguf"
AGREEMENT = DATA / "tokenizer_agreement.json"

TEXTS = [
    '',
    ' ',
    '  ',
    '\n',
    '\n\n\n',
    ' \n \n',
    '\t\t x',
    'Hello world',
    'Hello  world',
    'Hello   world   ',
    'hello\n\nworld\n',
    '   leading and trailing   ',
    'a\r\nb\rc',
    'The year 2024 had 365 days; 1234567890.',
    '3.14159 -42 +7 1e10 0x1F 1,000,000',
    "I'm sure it's 'quoted' they'll we've you'd I'M IT'S",
    'caf\xe9 na\xefve \xfcber \xc5ngstr\xf6m',
    '\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8',
    '\u4e2d\u6587 \ud55c\uad6d\uc5b4',
    'emoji \U0001f389\U0001f680 \U0001f468\u200d\U0001f469\u200d\U0001f467 ok',
    '\u0645\u0631\u062d\u0628\u0627 \u05e9\u05dc\u05d5\u05dd',
    '\u0417\u0434\u0440\u0430\u0432\u0441\u0442\u0432\u0443\u0439, \u043c\u0438\u0440!',
    '\xbd \u2153 \u2460 \u0663\u0664 \xb2\xb3',
    "def main():\n    return {'a': [1, 2, 3]}\n\n\nif __name__ == '__main__':\n\tmain()\n",
    'for (int i = 0; i < n; i++) { x[i] += y[i] * 2; } // c++',
    '<html><body class="x">&amp;</body></html>',
    '$100 + 50% = ~^|<=>`',
    '!!!??? ... ---- ____ ****',
    'a\xa0b\u2009c\u3000d',
    '<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>',
    '<|endoftext|><|endoftext|>text<|im_start|>',
    '<|im_start|',
    '<s>hello</s> <s> x',
    '<tool>call</tool>',
    '<0x41> <unk>',
    '\u2581already escaped\u2581',
    'the theme then there',
    'ZZZ zzz Zz',
    '\xe9\u0301 combining e\u0301',
    '\ufeffbom',
    'tab\tseparated\tvalues\n1\t2\t3',
    # chat markup of the families: special tokens and the whitespace beside them
    '<|user|>\nHi <|end|>\n<|assistant|>  ok</s> x',
    '<|system|> s <|end|>\n<|user|>\t q<|end|>',
    '<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n',
    '<bos><start_of_turn>user\n  two  spaces<end_of_turn>\n',
    '<start_of_image> <unused0>\n\n\n<mask>',
    '<|im_start|>  x <|im_end|>\n\n',
    '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>',
    '<bos><|turn>user\nhi<turn|>\n<|tool_response>x</s>',
    '</s> <s> <unk>  <|endoftext|>  x',
    '\n\n\n\n a \n\n b',
    # letter case inside words (GPT-4o's pre-tokenizer splits there; non-ASCII lowercase counts as upper)
    'HELLOworld \xc9clair \xc9COLE\xe9tudiant na\xefveT\xc9ST',
    "ABCdef aBC Abc's ABC'S x'Ll 1234567",
]

SPM_PIECES = [
    '\u2581', 't', 'h', 'e', 'a', 'r', 'n', 'o', 'd', 's', 'w', 'l', '\u2581t', 'he', '\u2581the', '\u2581a',
    're', '\u2581the\u2581', 'er', '\u2581w', 'or', 'ld', '\u2581wor', '\u2581world', '\u2581h', 'el', 'lo',
    '\u2581hel', '\u2581hello', 'in', 'an', '\u2581an', 'nd', '\u2581and', 'm', 'i', 'c', 'x', 'z', 'Z', '1',
    '2', '3', '12', '\u2581\u2581', '\u2581\u2581\u2581\u2581', '\n', '.', ',', "'", '\xe9', 'caf', 'caf\xe9',
]


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types of the small SentencePiece-style vocabulary (distinct scores)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["<tool>"] + SPM_PIECES
    types = [2, 3, 3] + [6] * 256 + [4] + [1] * len(SPM_PIECES)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [0.0] + [-float(i) for i in range(len(SPM_PIECES))]
    return tokens, scores, types


GEMMA3_PIECES = [
    '\u2581', '\u2581\u2581', '\u2581\u2581\u2581\u2581', '\n', '\n\n', '\n\n\n', 't', 'h', 'e', 'a', 'o', 'r', 'n',
    's', 'w', 'l', 'd', 'i', 'u', 'm', 'H', 'T', 'he', 'th', 'the', '\u2581the', '\u2581t', 'er', 'or', 'ld', '\u2581w',
    '\u2581wor', '\u2581world', 'el', 'lo', 'Hel', 'Hello', 'us', 'user', 'mod', 'model', 'in', 'an', '\u2581a',
    '\u2581an', 'and', '\u2581and', '.', ',', '!', '?', "'", '1', '2', '3', '12', '\xe9', 'caf', 'caf\xe9',
]


def gemma3_vocab() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types laid out as Gemma 3's GGUF has them (see the module docstring)."""
    head = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "<unused0>",
            "<start_of_image>"]
    head_types = [3, 3, 3, 2, 3, 3, 3, 3, 4]
    tokens = head + [f"<0x{b:02X}>" for b in range(256)] + GEMMA3_PIECES
    types = head_types + [6] * 256 + [1] * len(GEMMA3_PIECES)
    scores = [0.0] * (len(head) + 256) + [-float(i) for i in range(len(GEMMA3_PIECES))]
    return tokens, scores, types


def write_gemma3_vocab(path: Path) -> Path:
    """The gemma3 vocabulary as a GGUF llama.cpp loads with vocab_only (a llama's hparams)."""
    tokens, scores, types = gemma3_vocab()
    return _write_vocab(path, tokens, scores, types, bos=2, eos=1, unk=3, pad=0, add_space_prefix=False)


def write_spm_vocab(path: Path) -> Path:
    """The spm vocabulary as a GGUF llama.cpp loads with vocab_only (a llama's hparams, no tensors)."""
    tokens, scores, types = spm_vocab()
    return _write_vocab(path, tokens, scores, types, bos=1, eos=2, unk=0)


def _write_vocab(path: Path, tokens, scores, types, bos: int, eos: int, unk: int, pad: int | None = None,
                 add_space_prefix: bool | None = None) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_unk_token_id(unk)
    if pad is not None:
        w.add_pad_token_id(pad)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tokenizer_only(model: Path, out: Path) -> Path:
    """A copy of `model`'s metadata (tokenizer and hparams), without tensors."""
    import gguf

    r = gguf.GGUFReader(str(model))
    w = gguf.GGUFWriter(str(out), r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(key, f.contents(), f.types[0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def llama_cpp_ids(tool: str, vocab: Path, texts: list[str], workdir: Path) -> list[list[int]]:
    """llama.cpp's ids (add_special and parse_special on) for each text."""
    blob = workdir / "texts.bin"
    blob.write_bytes(b"".join(struct.pack("<I", len(t.encode())) + t.encode() for t in texts))
    res = subprocess.run([tool, str(vocab), str(blob)], capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"th_tokenize failed: {res.stderr[-2000:]}")
    lines = res.stdout.split("\n")[:len(texts)]
    return [[int(x) for x in line.split()] for line in lines]


VOCABS = ("phi-3", "qwen2", "qwen35", "llama-spm", "llama-bpe", "gpt-2", "gemma-4")


def vocab_folder() -> Path:
    """llama.cpp's models folder from the pinned archive (native/build.py fetches it once into the
    cache; the build's own fetch of the archive already extracts it)."""
    res = subprocess.run([sys.executable, str(DATA.parent.parent / "native" / "build.py"), "--print-vocab"],
                         capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"native/build.py --print-vocab failed: {res.stderr[-1000:]}")
    return Path(res.stdout.strip().splitlines()[-1])


def padded_copy(vocab: Path, out: Path) -> Path:
    """llama.cpp's vocab-only files end right after their metadata; toyharness' GGUF reader wants
    the data section's alignment padding (32 bytes) even with no tensors, so tests read a copy
    with the padding added (the metadata unchanged)."""
    data = vocab.read_bytes()
    out.write_bytes(data + b"\0" * (-len(data) % 32))
    return out


# vocabularies of another pre-tokenizer: (name, llama.cpp vocabulary it is made from, the pre)
PRE_VARIANTS = (("gpt-4o", "llama-bpe", "gpt-4o"),)   # Phi-4-mini's and Llama 4's pre-tokenizer


def write_pre_variant(vocab: Path, pre: str, out: Path) -> Path:
    """A copy of a vocabulary-only GGUF with another `tokenizer.ggml.pre` (and the padding of
    padded_copy): llama.cpp's ids for it check our regexes for that pre-tokenizer. A vocab-only
    file has no tensor offsets to move, so the string is swapped in place."""
    import struct as st

    data = vocab.read_bytes()
    key = b"tokenizer.ggml.pre"
    head = st.pack("<Q", len(key)) + key + st.pack("<I", 8)
    at = data.index(head) + len(head)
    n = st.unpack_from("<Q", data, at)[0]
    data = data[:at] + st.pack("<Q", len(pre.encode())) + pre.encode() + data[at + 8 + n:]
    out.write_bytes(data + b"\0" * (-len(data) % 32))
    return out


def expected_cases(vocab: Path) -> list[tuple[str, list[int]]]:
    """llama.cpp's own cases for a ggml-vocab file: its .inp texts (split as llama.cpp's
    tests/test-tokenizer-0.cpp splits them) with the .out ids (add_special and parse_special off)."""
    texts = Path(f"{vocab}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    lines = Path(f"{vocab}.out").read_text(encoding="utf-8").split("\n")
    if len(lines) < len(texts):
        raise RuntimeError(f"{vocab}: {len(texts)} texts but {len(lines)} lines of ids")
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


def derive(tool: str, workdir: Path) -> dict:
    spm = write_spm_vocab(workdir / "spm.gguf")
    gemma3 = write_gemma3_vocab(workdir / "gemma3.gguf")
    ids = {"smollm2": llama_cpp_ids(tool, SMOLLM2_VOCAB, TEXTS, workdir),
           "spm": llama_cpp_ids(tool, spm, TEXTS, workdir),
           "gemma3": llama_cpp_ids(tool, gemma3, TEXTS, workdir)}
    folder = vocab_folder()
    for name in VOCABS:
        ids[name] = llama_cpp_ids(tool, folder / f"ggml-vocab-{name}.gguf", TEXTS, workdir)
    for name, base, pre in PRE_VARIANTS:
        variant = write_pre_variant(folder / f"ggml-vocab-{base}.gguf", pre, workdir / f"{name}.gguf")
        ids[name] = llama_cpp_ids(tool, variant, TEXTS, workdir)
    return {"texts": TEXTS, "ids": ids}


if __name__ == "__main__":
    import tempfile

    if len(sys.argv) < 2:
        sys.exit("usage: python tests/tokenizer_cases.py PATH/th_tokenize [--write] [--smollm2-from MODEL.gguf]")
    if "--smollm2-from" in sys.argv:
        write_tokenizer_only(Path(sys.argv[sys.argv.index("--smollm2-from") + 1]), SMOLLM2_VOCAB)
    with tempfile.TemporaryDirectory() as tmp:
        doc = derive(sys.argv[1], Path(tmp))
    if "--write" in sys.argv:
        AGREEMENT.write_text(json.dumps(doc, ensure_ascii=True, indent=1) + "\n")
        print(f"wrote {AGREEMENT}")
    else:
        print(json.dumps(doc)[:2000])
