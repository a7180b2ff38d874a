"""The GGUF tokenizer against llama.cpp's ids (tests/data/tokenizer_agreement.json, derived with
native/llamacpp/th_tokenize; the `llamacpp` session derives them again), decoding, and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizer_cases as cases

from toyharness.data.chat import render_chat
from toyharness.errors import InputError
from toyharness.switches import switch
from toyharness.tokenizer import ByteTokenizer, GGUFTokenizer, load_tokenizer

AGREEMENT = json.loads(cases.AGREEMENT.read_text()) if cases.AGREEMENT.is_file() else None
needs_file = pytest.mark.skipif(AGREEMENT is None, reason="tests/data/tokenizer_agreement.json not derived yet "
                                                          "(python tests/tokenizer_cases.py TOOL --write)")


@pytest.fixture(scope="module")
def smollm2():
    return GGUFTokenizer.from_gguf(cases.SMOLLM2_VOCAB)


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    return GGUFTokenizer.from_gguf(cases.write_spm_vocab(tmp_path_factory.mktemp("spm") / "spm.gguf"))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return GGUFTokenizer.from_gguf(cases.write_gemma3_vocab(tmp_path_factory.mktemp("gemma3") / "gemma3.gguf"))


def _vocab(name: str, request, tmp_path_factory) -> GGUFTokenizer:
    if name in ("smollm2", "spm", "gemma3"):
        return request.getfixturevalue(name)
    try:
        folder = cases.vocab_folder()
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"llama.cpp's models folder of the pinned archive could not be fetched: {exc}")
    out = tmp_path_factory.mktemp(name) / f"{name}.gguf"
    for variant, base, pre in cases.PRE_VARIANTS:
        if name == variant:
            return GGUFTokenizer.from_gguf(cases.write_pre_variant(folder / f"ggml-vocab-{base}.gguf", pre, out))
    return GGUFTokenizer.from_gguf(cases.padded_copy(folder / f"ggml-vocab-{name}.gguf", out))


@needs_file
@pytest.mark.parametrize("vocab", ["smollm2", "spm", "gemma3", *cases.VOCABS, *(v[0] for v in cases.PRE_VARIANTS)])
def test_ids_equal_llama_cpp(vocab, request, tmp_path_factory):
    """add_special and parse_special on, as data and prompts are encoded."""
    tok = _vocab(vocab, request, tmp_path_factory)
    assert AGREEMENT["texts"] == cases.TEXTS, "texts changed: derive the file again"
    wrong = [(t, tok.encode(t, add_special=True), want)
             for t, want in zip(AGREEMENT["texts"], AGREEMENT["ids"][vocab])
             if tok.encode(t, add_special=True) != want]
    print(f"{vocab}: {len(cases.TEXTS) - len(wrong)}/{len(cases.TEXTS)} texts agree with llama.cpp")
    assert not wrong, f"{len(wrong)} of {len(cases.TEXTS)} texts differ; first: {wrong[0]}"


def test_gemma3_has_no_space_prefix_and_falls_back_to_bytes(gemma3):
    """Gemma 3's file says add_space_prefix false: no U+2581 before the text or after a special
    token; characters that are no piece come out as their UTF-8 bytes; BOS added, no EOS."""
    ids = gemma3.encode("<start_of_turn>user\nHello w\u00fc", add_special=True)
    assert [gemma3.tokens[i] for i in ids] == ["<bos>", "<start_of_turn>", "user", "\n", "Hello", "\u2581w",
                                               "<0xC3>", "<0xBC>"]
    assert gemma3.decode(ids) == "user\nHello w\u00fc"
    assert {gemma3.tokens[i] for i in gemma3.end_ids} == {"<eos>", "<end_of_turn>"}


def test_smollm2_decodes_what_it_encodes(smollm2):
    for text in cases.TEXTS:
        assert smollm2.decode(smollm2.encode(text), keep_special=True) == text


def test_spm_byte_fallback_and_space_prefix(spm):
    ids = spm.encode("hello w\u00fc", add_special=True)
    # the highest-scoring pair merges first ("he" outranks "\u2581h"); u-umlaut is no piece: its
    # two UTF-8 bytes come out as byte tokens
    assert [spm.tokens[i] for i in ids] == ["<s>", "\u2581", "he", "l", "lo", "\u2581w", "<0xC3>", "<0xBC>"]
    assert spm.decode(ids) == " hello w\u00fc"


def test_special_ids_and_end_of_turn(smollm2):
    assert smollm2.encode("<|im_start|>") == [1]
    assert smollm2.eos_id == 2 and 2 in smollm2.end_ids
    assert not smollm2.add_bos


def test_chat_template_renders_as_transformers_does(smollm2):
    text = render_chat(smollm2, [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_byte_tokenizer_is_utf8():
    tok = load_tokenizer("")
    assert isinstance(tok, ByteTokenizer)
    assert tok.encode("h\u00e9") == [104, 0xC3, 0xA9] and tok.decode([104, 0xC3, 0xA9]) == "h\u00e9"


def test_bad_files_are_named(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"nope")
    with pytest.raises(InputError, match="junk.gguf: not a GGUF"):
        load_tokenizer(junk)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(cases.SMOLLM2_VOCAB.read_bytes()[:100_000])
    with pytest.raises(InputError, match="cut.gguf: truncated or corrupt"):
        load_tokenizer(cut)


@pytest.mark.llamacpp
@pytest.mark.skipif(not switch("TOYHARNESS_LLAMACPP_TOOL"), reason="llama.cpp's tools are not built: "
                                                                          "run `nox -s llamacpp`")
def test_committed_ids_are_llama_cpps(tmp_path):
    tool = Path(switch("TOYHARNESS_LLAMACPP_TOOL")).with_name("th_tokenize")
    assert AGREEMENT == cases.derive(str(tool), tmp_path)


def test_a_byte_token_that_is_not_0xhh_is_named():
    """A SentencePiece vocabulary's byte tokens read <0xHH>; another text (found by the fuzzer) was
    a ValueError from int(..., 16) at decode time."""
    from toyharness.tokenizer import BYTE, NORMAL

    with pytest.raises(InputError, match=r"tokenizer.ggml.tokens\[1\] is a byte token \(type 6\) but reads 'h', "
                                         r"not <0xHH>"):
        GGUFTokenizer("llama", ["<0x41>", "h", "a"], [BYTE, BYTE, NORMAL])
