"""Our tokenizer against llama.cpp's own vocabularies and expectations: the ggml-vocab-*.gguf files
of the pinned archive's models folder (Phi-3's SPM, Qwen2.5/Qwen3's BPE `qwen2`, Qwen3.5's `qwen35`,
Llama 2's SPM, Llama 3's BPE, GPT-2's, Gemma 4's BPE `gemma4`) with their .inp texts and the .out ids
llama.cpp's tests expect; and the special-token rules llama.cpp adds beyond the files' token types.

These run in the default suite: the folder comes from the same archive the native build fetches
(native/build.py extracts it from that download, 75 MB on disk, or fetches it once into the cache
where an older cache lacks it); loading all seven vocabularies takes a few seconds. Where the
archive cannot be fetched they skip, saying so."""

from __future__ import annotations

import re
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
        if name == "gemma3" and name not in loaded:     # ours, laid out as Gemma 3's (tokenizer_cases.py)
            loaded[name] = GGUFTokenizer.from_gguf(cases.write_gemma3_vocab(out / "gemma3.gguf"))
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


# --- chat templates: each family's, rendered as toyharness/data renders them ---------------------
# (None: the template the vocabulary GGUF itself carries; else a file of the archive's
# models/templates. Gemma 3's own template is in neither: Gemma 2's has its turn markup and its
# raise_exception checks, rendered here over our Gemma 3-style vocabulary; Gemma 4's vocabulary
# carries Gemma 4's.)
CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}]
CHATS = {
    "phi-3": ("phi-3", None, CONV[1:],
              "<s><|user|>\nHi<|end|>\n<|assistant|>\nHello<|end|>\n<|user|>\n2+2?<|end|>\n<|assistant|>\n4<|end|>\n"),
    "phi-3.5": ("phi-3", "microsoft-Phi-3.5-mini-instruct.jinja", CONV,
                "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello<|end|>\n"
                "<|user|>\n2+2?<|end|>\n<|assistant|>\n4<|end|>\n<|endoftext|>"),
    "qwen2": ("qwen2", None, CONV,
              "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello"
              "<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"),
    "qwen2.5": ("qwen2", "Qwen-Qwen2.5-7B-Instruct.jinja", CONV[1:3],
                "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
                "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"),
    "qwen3": ("qwen2", "Qwen-Qwen3-0.6B.jinja", CONV,
              "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello"
              "<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n"),
    "gemma2/3": ("gemma3", "google-gemma-2-2b-it.jinja", CONV[1:],
                 "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
                 "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n"),
    "gemma4": ("gemma-4", None, CONV,
               "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\nHello<turn|>\n"
               "<|turn>user\n2+2?<turn|>\n<|turn>model\n4<turn|>\n"),
}


def _chat_tokenizer(vocabs, vocab_dir, name: str, template: str | None):
    import dataclasses

    tok = vocabs(name)
    if template is None:
        assert tok.chat_template, f"{name}'s vocabulary carries no chat template"
        return tok
    return dataclasses.replace(tok, chat_template=(vocab_dir / "templates" / template).read_text(encoding="utf-8"))


@pytest.mark.parametrize("family", list(CHATS))
def test_chat_templates_render_and_tokenize(family, vocabs, vocab_dir):
    from toyharness.data.chat import render_chat

    name, template, msgs, want = CHATS[family]
    tok = _chat_tokenizer(vocabs, vocab_dir, name, template)
    text = render_chat(tok, msgs)
    assert text == want
    ids = tok.encode(text)            # as the data code encodes it: markup strings become their ids
    markup = {"phi-3": "<|end|>", "qwen2": "<|im_end|>", "gemma-4": "<turn|>", "gemma3": "<end_of_turn>"}[name]
    assert ids.count(tok._vocab[markup]) == text.count(markup) >= 2
    if name == "phi-3":
        # llama.cpp drops the whitespace after Phi-3's markup (RSTRIP); SPM then prefixes a space
        text = re.sub(r"(<\|\w+\|>)(?=[^<])", r"\1 ", re.sub(r"(<\|\w+\|>)\s+", r"\1", text))
    assert tok.decode(ids, keep_special=True) == text


def test_llama32_template_uses_strftime_now(vocabs, vocab_dir):
    from datetime import datetime

    from toyharness.data.chat import render_chat

    tok = _chat_tokenizer(vocabs, vocab_dir, "llama-bpe", "meta-llama-Llama-3.2-3B-Instruct.jinja")
    before = datetime.now().strftime("%d %b %Y")
    text = render_chat(tok, CONV[:2], add_generation_prompt=True)
    dates = {before, datetime.now().strftime("%d %b %Y")}
    assert any(text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
                        f"December 2023\nToday Date: {d}\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>"
                        "\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n") for d in dates)
    assert tok.encode(text)[0] == tok.bos_id == 128000


def test_gemmas_template_raises_by_its_own_message(vocabs, vocab_dir):
    from toyharness.data.chat import TemplateError, render_chat

    tok = _chat_tokenizer(vocabs, vocab_dir, "gemma3", "google-gemma-2-2b-it.jinja")
    with pytest.raises(TemplateError, match="chat template: System role not supported"):
        render_chat(tok, CONV)
    with pytest.raises(TemplateError, match="Conversation roles must alternate"):
        render_chat(tok, [CONV[1], CONV[3]])


@pytest.mark.parametrize("family", ["qwen2", "gemma2/3", "phi-3", "qwen3", "gemma4"])
def test_mask_prompt_counts_exactly_the_assistant_turns(family, vocabs, vocab_dir):
    from toyharness.data.jsonl import encode_example

    name, template, msgs, _ = CHATS[family]
    tok = _chat_tokenizer(vocabs, vocab_dir, name, template)
    ex = encode_example({"messages": msgs}, tok, True, "line 1")
    counted = tok.decode([i for i, c in zip(ex.ids, ex.counts) if c], keep_special=True)
    if name == "phi-3":      # no newline after <|end|> (RSTRIP), a space prefix before each reply
        assert counted == " Hello<|end|> 4<|end|>"
        return
    end = {"qwen2": "<|im_end|>\n", "gemma-4": "<turn|>\n", "gemma3": "<end_of_turn>\n"}[name]
    assert counted == f"Hello{end}4{end}"


def test_an_ambiguous_fim_token_is_refused_by_name():
    """Two normal tokens that could each be the FIM prefix, and no key naming one: llama.cpp makes
    whichever its hash map yields first a control token, so the ids would depend on that order."""
    tokens = ["<unk>", "<s>", "</s>", "<PRE>", "<fim_prefix>", "a"]
    with pytest.raises(InputError, match=r"tokens \['<fim_prefix>', '<PRE>'\] could each be the fim_pre token "
                                         r"and the file names none \(tokenizer.ggml.fim_pre_token_id\)"):
        GGUFTokenizer("llama", tokens, [2, 3, 3, 1, 1, 1])
    # named by the file: llama.cpp looks for none by text and leaves both tokens as they are
    named = GGUFTokenizer("llama", tokens, [2, 3, 3, 1, 1, 1], special_ids={"fim_pre": 3})
    assert not named.attrs[3] & A_CONTROL and not named.attrs[4] & A_CONTROL


def test_mask_prompt_refuses_what_it_cannot_locate_by_name(vocabs):
    """A template that renders a turn's content only when it is the last message, and an empty
    assistant turn: refused, naming the line and the turn, never masked wrongly."""
    import dataclasses

    from toyharness.data.jsonl import encode_example

    hiding = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role != 'assistant' or loop.last %}"
              "{{ m.content }}{% else %}(hidden){% endif %}<|im_end|>\n{% endfor %}")
    tok = dataclasses.replace(vocabs("qwen2"), chat_template=hiding)
    with pytest.raises(InputError, match=r"^line 3: assistant turn 1: its content is not where the chat template "
                                         r"renders the conversation; set mask_prompt=false$"):
        encode_example({"messages": CONV[1:]}, tok, True, "line 3")
    assert encode_example({"messages": CONV[1:]}, tok, False, "line 3").counts   # without masking: all counted
    empty = [CONV[1], {"role": "assistant", "content": " "}]
    with pytest.raises(InputError, match=r"^line 4: assistant turn 1 is empty"):
        encode_example({"messages": empty}, tok, True, "line 4")
