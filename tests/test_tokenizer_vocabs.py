"""Our tokenizer against llama.cpp's own vocabularies and expectations: the ggml-vocab-*.gguf files
of the pinned archive's models folder (Phi-3's SPM, Qwen2.5/Qwen3's BPE `qwen2`, Qwen3.5's `qwen35`,
Llama 2's SPM, Llama 3's BPE, GPT-2's, Gemma 4's BPE `gemma4`) with their .inp texts and the .out ids
llama.cpp's tests expect; and the special-token rules llama.cpp adds beyond the files' token types.

These run in the default suite: the folder comes from the same archive the native build fetches
(native/build.py extracts it from that download, 75 MB on disk, or fetches it once into the cache
where an older cache lacks it); loading all seven vocabularies takes a few seconds. Where the
archive cannot be fetched they skip, saying so."""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizer_cases as cases

from toyharness.errors import InputError
from toyharness.tokenizer import A_CONTROL, A_RSTRIP, GGUFTokenizer


@pytest.fixture(scope="session")
def vocab_dir() -> Path:
    try:
        return cases.vocab_folder()
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"llama.cpp's models folder of the pinned archive could not be fetched: {exc}")


@pytest.fixture(scope="session")
def vocabs(vocab_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("vocabs")
    loaded: dict[str, GGUFTokenizer] = {}

    def get(name: str) -> GGUFTokenizer:
        if name not in loaded:
            loaded[name] = GGUFTokenizer.from_gguf(cases.padded_copy(vocab_dir / f"ggml-vocab-{name}.gguf",
                                                                     out / f"{name}.gguf"))
        return loaded[name]
    return get


@pytest.mark.parametrize("name", cases.VOCABS)
def test_ids_equal_llama_cpps_expected_ids(name, vocab_dir, vocabs):
    tok = vocabs(name)
    expected = cases.expected_cases(vocab_dir / f"ggml-vocab-{name}.gguf")
    assert len(expected) >= 45
    wrong = [(text, tok.encode(text, parse_special=False), ids) for text, ids in expected
             if tok.encode(text, parse_special=False) != ids]
    print(f"{name}: {len(expected) - len(wrong)}/{len(expected)} of llama.cpp's cases agree")
    assert not wrong, f"{len(wrong)} of {len(expected)} differ; first: {wrong[0]}"


@pytest.mark.parametrize("name", cases.VOCABS)
def test_decode_round_trips(name, vocab_dir, vocabs):
    """Decoding gives the text back (SPM: after the space prefix it adds; an escaped-space
    character U+2581 in the input comes back as a space in every SPM-style vocabulary)."""
    tok = vocabs(name)
    texts = [t for t, _ in cases.expected_cases(vocab_dir / f"ggml-vocab-{name}.gguf")] + cases.TEXTS
    prefix = " " if tok.model == "llama" and tok.add_space_prefix else ""
    for text in texts:
        if tok.model != "gpt2" and "\u2581" in text:
            continue
        ids = tok.encode(text, parse_special=False)
        assert tok.decode(ids) == (prefix + text if text else ""), (name, text)


def test_the_families_tokenizers(vocabs):
    """What each family's file says, read as llama.cpp reads it."""
    phi3, qwen, gemma4, llama3 = vocabs("phi-3"), vocabs("qwen2"), vocabs("gemma-4"), vocabs("llama-bpe")
    assert (phi3.model, phi3.add_bos, phi3.bos_id, phi3.eos_id) == ("llama", True, 1, 32000)
    assert (qwen.model, qwen.pre, qwen.add_bos) == ("gpt2", "qwen2", False)
    assert (llama3.pre, llama3.add_bos, llama3.bos_id) == ("llama-bpe", True, 128000)   # llama3's default BOS
    assert (gemma4.model, gemma4.vocab_size, gemma4.add_bos, gemma4.bos_id) == ("gemma4", 262144, True, 2)
    assert qwen.tokens[next(iter(qwen.end_ids & {qwen._vocab["<|im_end|>"]}))] == "<|im_end|>"
    assert {gemma4.tokens[i] for i in gemma4.end_ids} == {"<eos>", "<turn|>", "<|tool_response>"}


def test_phi3s_special_tokens_eat_the_whitespace_after_them(vocabs):
    """llama.cpp gives Phi-3's special tokens (but <s>, <unk>, <|endoftext|>) the RSTRIP attribute
    by general.name: the whitespace after <|end|> or <|user|> is not tokenized."""
    phi3 = vocabs("phi-3")
    end = phi3._vocab["<|end|>"]
    assert phi3.attrs[end] & A_RSTRIP and not phi3.attrs[phi3._vocab["<s>"]] & A_RSTRIP
    assert phi3.encode("<|user|>\nHi<|end|>\n x") == [32010, 6324, 32007, 921]
    assert phi3.encode("<|user|>\nHi<|end|>\n x") == phi3.encode("<|user|>Hi<|end|>x")


def test_end_of_generation_texts_are_control_tokens(vocabs):
    """A normal-typed token whose text llama.cpp takes for an end of generation (Qwen's '</s>') is
    made a control token: split off as special and decoded to nothing."""
    qwen = vocabs("qwen2")
    s = qwen._vocab["</s>"]
    assert qwen.types[s] != 3 and qwen.attrs[s] & A_CONTROL and s in qwen.end_ids
    assert qwen.encode("a</s>b") == qwen.encode("a") + [s] + qwen.encode("b")
    assert qwen.decode(qwen.encode("a</s>b")) == "ab"


def test_gemma4_bos_is_forced_and_newline_runs_taken_whole(vocabs):
    gemma4 = vocabs("gemma-4")
    ids = gemma4.encode("a\n\n\n\n\n b", add_special=True)
    assert ids[0] == gemma4.bos_id and gemma4.tokens[ids[2]] == "\n\n\n\n\n"
    assert gemma4.decode(ids) == "a\n\n\n\n\n b"
    assert [gemma4.tokens[i] for i in gemma4.encode("\U0001f9ec")][:1] != ["<unk>"]


def test_unknown_models_and_pre_tokenizers_are_refused_by_name(vocabs):
    qwen = vocabs("qwen2")
    with pytest.raises(InputError, match="pre-tokenizer 'qwen9' is not supported"):
        GGUFTokenizer("gpt2", qwen.tokens[:300], qwen.types[:300], pre="qwen9", merges=["a b"])
    with pytest.raises(InputError, match="pre-tokenizer 'gpt2' is not supported"):   # llama.cpp spells it gpt-2
        GGUFTokenizer("gpt2", qwen.tokens[:300], qwen.types[:300], pre="gpt2", merges=["a b"])
    with pytest.raises(InputError, match="tokenizer model 'ugm' is not supported; supported: gpt2, llama, gemma4"):
        GGUFTokenizer("ugm", ["a"], [1])
