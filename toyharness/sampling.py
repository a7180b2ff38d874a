"""Sampling: the one loop that turns a model's logits into text (`generate`), over either of two
ways of getting the logits after the text so far, each with `context`, `reset()` and `extend(ids)`:

- `CachedLM`, with a KV cache: each new token costs one token's forward, not the whole window's.
  The recipe's own forward is built twice on one program, for a chunk of new tokens (the prompt,
  `prefill` at a time) and for one token, while the program's `kv_cache` is set: each
  `blocks.attention` call then writes its (roped) keys and values into that layer's cache at the
  tokens' positions (ggml's SET_ROWS into a persistent tensor, so the cache lives on the backend,
  cpu or cuda) and its queries attend over every cached position that a mask fed per step lets
  them see (causal, and each sliding window: gemma3's local layers). Every architecture the
  recipes take runs through it unchanged, adapters included.
- `FullRecompute`, the reference (`sample --no-cache`): the recipe's training-shaped forward over
  a fixed window of t_seq positions, the text left-aligned, recomputed for each new token.

Both give the same tokens for the same seed: the same choice rule (`next_token`) on logits equal
to rounding (a product of one row and one of many sum in another order); once the text outgrows
`context` both slide the same window (the last `context` tokens, from position 0, recomputed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from ._ffi import lib
from .engine import Tensor, get_engine
from .errors import InputError, ShapeError
from .lm import LanguageModel

PREFILL = 32   # prompt tokens per forward; the rest of a prompt goes one token at a time


class SamplingRecipe(Protocol):
    """What the cached sampler calls on a recipe (toyharness.lm.LMRecipe has it all); any recipe
    with these methods samples, whatever its name or base class."""

    name: str

    def build_params(self, prog, options, vocab: int, values: dict[str, np.ndarray], trainable: bool) -> dict: ...

    def forward(self, P: dict, tokens: Tensor, positions: Tensor, options) -> Tensor: ...

    def params_for_sampling(self, path, options, vocab: int) -> dict[str, np.ndarray]: ...

    def vocab_for(self, options, data_vocab: int) -> int: ...


class KVCache:
    """The per-layer caches and masks of one program, handed to blocks.attention while a graph
    is built (layers are told apart by the order of their attention calls, as the forward runs)."""

    def __init__(self, prog, context: int):
        self.prog, self.context = prog, context
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        self.windows: set[int | None] = set()
        self._layer = 0
        self._n = 0
        self._positions: Tensor | None = None

    def begin(self, n: int, positions: Tensor) -> None:
        """Start building the graph for `n` new tokens at `positions` (an i32 input (n,))."""
        self._layer, self._n, self._positions = 0, n, positions

    def mask_name(self, n: int, window: int | None) -> str:
        return f"kv.mask.{n}.{window or 'all'}"

    def attend(self, q: Tensor, k: Tensor, v: Tensor, hd: int, scale: float, window: int | None) -> Tensor:
        """q (B, H, n, hd) and k (B, Hkv, n, hd) roped, v (B, n, Hkv, hd): attention of the n new
        queries over the layer's cache, which now holds these keys and values too; (B, n, H*hd)."""
        b, n_head, n, _ = q.shape
        n_kv = k.shape[1]
        if b != 1 or n != self._n:
            raise ShapeError(f"kv cache: built for 1 sequence of {self._n} new tokens, got {q.shape}")
        i = self._layer
        self._layer += 1
        width = n_kv * hd
        if i == len(self.k):        # the first graph built makes the layer's cache
            self.k.append(self.prog.param(f"kv.{i}.k", np.zeros((self.context, width), np.float32), trainable=False))
            self.v.append(self.prog.param(f"kv.{i}.v", np.zeros((self.context, width), np.float32), trainable=False))
        if self.k[i].shape[1] != width:
            raise ShapeError(f"kv cache: layer {i} has {width} key columns, the cache {self.k[i].shape[1]}")
        rows_k = k.permute(0, 2, 1, 3).cont().reshape(n, width)
        rows_v = v.reshape(n, width)
        ctx, pos = self.prog._ctx_compute, self._positions
        k_all = rows_k._new(lib.ggml_set_rows(ctx, self.k[i].ptr, rows_k.ptr, pos.ptr), 2)     # (context, width)
        v_all = rows_v._new(lib.ggml_set_rows(ctx, self.v[i].ptr, rows_v.ptr, pos.ptr), 2)
        t = self.context
        rep = n_head // n_kv
        keys = k_all.reshape(1, t, n_kv, hd).permute(0, 2, 1, 3).repeat_heads(rep)          # (1, H, t, hd)
        vt = v_all.reshape(1, t, n_kv, hd).permute(0, 2, 3, 1).cont().repeat_heads(rep)     # (1, H, hd, t)
        name = self.mask_name(n, window)
        mask = self.prog.inputs[name].tensor if name in self.prog.inputs else self.prog.input(name, (n, t))
        self.windows.add(window)
        scores = q.reshape(n_head, n, hd).bmm_t(keys.reshape(n_head, t, hd))                 # (H, n, t)
        probs = scores._new(lib.ggml_soft_max_ext(ctx, scores.ptr, mask.ptr, float(scale), 0.0))
        out = probs.bmm_t(vt.reshape(n_head, hd, t)).reshape(1, n_head, n, hd)
        return out.permute(0, 2, 1, 3).cont().reshape(1, n, n_head * hd)

    def masks(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        """The masks for new tokens at `positions`: query i sees cached positions j <= p_i (and
        p_i - j < window). Positions beyond the text hold stale or zero rows: never seen."""
        j = np.arange(self.context)[None, :]
        p = positions[:, None]
        out = {}
        for w in self.windows:
            seen = (j <= p) if w is None else (j <= p) & (p - j < w)
            # -1e30, not -inf (inputs are refused with infinities): its exp is exactly 0 too
            out[self.mask_name(len(positions), w)] = np.where(seen, 0.0, -1e30).astype(np.float32)
        return out


class CachedLM:
    """A language-model recipe's forward with a KV cache, for one sequence at a time."""

    def __init__(self, recipe: SamplingRecipe, engine, options, vocab: int, params: dict[str, np.ndarray],
                 context: int | None = None, prefill: int = PREFILL, dequantize: bool = False):
        self.recipe, self.options, self.vocab = recipe, options, vocab
        self.context = context or options.t_seq
        if self.context < 1:
            raise InputError(f"kv cache: context {self.context} must be >= 1")
        self.prog = engine.program()
        self.prog.dequantize_frozen = dequantize
        P = recipe.build_params(self.prog, options, vocab, params, False)
        self.cache = KVCache(self.prog, self.context)
        self.graphs = {}
        self.prog.kv_cache = self.cache
        try:
            for n in sorted({1, max(1, min(prefill, self.context))}):
                tokens = self.prog.input(f"kv.tokens.{n}", (1, n), "i32", upper=vocab)
                positions = self.prog.input(f"kv.positions.{n}", (n,), "i32", upper=self.context)
                self.cache.begin(n, positions)
                logits = recipe.forward(P, tokens, positions, options)
                if self.cache._layer == 0:
                    raise InputError(f"recipe {recipe.name}: its forward has no attention to cache; sample it "
                                     "with --no-cache")
                self.graphs[n] = self.prog.forward({"logits": logits.reshape(n, vocab)})
        finally:
            self.prog.kv_cache = None
        self.length = 0          # positions [0, length) of the cache hold the text so far

    def reset(self) -> None:
        self.length = 0          # stale rows stay; the masks hide them until overwritten

    def extend(self, ids: list[int]) -> np.ndarray:
        """Append `ids` to the cached text; the logits (vocab,) after its last token."""
        if not ids:
            raise InputError("kv cache: nothing to add")
        if self.length + len(ids) > self.context:
            raise InputError(f"kv cache: {self.length} + {len(ids)} tokens do not fit a context of {self.context}")
        chunk = max(self.graphs)
        logits = None
        while ids:
            n = chunk if len(ids) >= chunk else 1
            pos = np.arange(self.length, self.length + n, dtype=np.int32)
            feeds = {f"kv.tokens.{n}": np.asarray(ids[:n], np.int32).reshape(1, n), f"kv.positions.{n}": pos,
                     **self.cache.masks(pos)}
            logits = self.graphs[n].run(feeds)["logits"][-1]
            ids, self.length = ids[n:], self.length + n
        return logits


def load_cached(recipe: SamplingRecipe, path, options, vocab: int, backend: str = "cpu", threads: int | None = None,
                context: int | None = None, dequantize: bool = False) -> CachedLM:
    """A recipe's `load_for_sampling` (toyharness.lm.LMRecipe's), with a KV cache; `dequantize`: a
    quantized base held as f32."""
    params = recipe.params_for_sampling(path, options, vocab)
    vocab = recipe.vocab_for(options, vocab)
    return CachedLM(recipe, get_engine(backend, threads), options, vocab, params, context, dequantize=dequantize)


class FullRecompute:
    """The reference sampler's model (`sample --no-cache`): a forward-only `LanguageModel` of one
    row, whose whole window (the text left-aligned, zeros after it) is recomputed for each call of
    `extend`; the interface of `CachedLM`."""

    def __init__(self, model: LanguageModel):
        if model.batch != 1:
            raise ShapeError(f"the full recompute samples one sequence: the model is built for {model.batch}")
        self.model, self.context = model, model.seq
        self.text: list[int] = []

    def reset(self) -> None:
        self.text = []

    def extend(self, ids: list[int]) -> np.ndarray:
        """Append `ids` to the text; the logits (vocab,) after its last token."""
        if not ids:
            raise InputError("full recompute: nothing to add")
        if len(self.text) + len(ids) > self.context:
            raise InputError(f"full recompute: {len(self.text)} + {len(ids)} tokens do not fit a window of "
                             f"{self.context}")
        self.text += ids
        window = np.zeros((1, self.context), np.int32)
        window[0, :len(self.text)] = self.text
        return self.model.next_logits(window)[0, len(self.text) - 1]


def generate(model: CachedLM | FullRecompute, prompt: list[int], n_tokens: int, temperature: float, top_k: int,
             seed: int, stop_ids: frozenset[int] = frozenset(),
             on_token: Callable[[int], None] | None = None) -> list[int]:
    """Up to `n_tokens` new tokens after `prompt` (empty: a newline), each chosen by `next_token`
    from a generator seeded with `seed`; stops before a token of `stop_ids` (end of sequence or of
    turn; not returned). Text longer than the model's `context` is read through a sliding window of
    its last `context` tokens."""
    if temperature < 0:
        raise InputError(f"--temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise InputError(f"--top-k must be >= 0, got {top_k}")
    rng = np.random.default_rng(seed)
    ids = list(prompt) or [ord("\n")]
    start = len(prompt) or 1
    seq = model.context
    model.reset()
    logits = model.extend(ids[-seq:])
    for step in range(n_tokens):
        if step and len(ids) <= seq:
            logits = model.extend(ids[-1:])
        elif step:
            # past the context: the window of the last `seq` tokens from position 0, recomputed
            model.reset()
            logits = model.extend(ids[-seq:])
        nxt = next_token(logits, temperature, top_k, rng)
        if nxt in stop_ids:
            break
        ids.append(nxt)
        if on_token:
            on_token(nxt)
    return ids[start:]


def next_token(logits: np.ndarray, temperature: float, top_k: int, rng: np.random.Generator) -> int:
    """The next token from one position's logits: argmax at temperature 0, else a draw from the
    softmax of logits / temperature over the top_k (0: all)."""
    logits = logits.astype(np.float64)
    if temperature == 0:
        return int(np.argmax(logits))
    logits = logits / temperature
    if 0 < top_k < len(logits):
        cutoff = np.sort(logits)[-top_k]
        logits = np.where(logits < cutoff, -np.inf, logits)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    return int(rng.choice(len(p), p=p))


# --- a file of prompts: `toyharness sample RUN_DIR --prompts FILE` ------------------------------------
PROMPT_KEYS = ("prompt", "completion", "messages")


def read_prompts(path, tokenizer, chat: bool) -> list[dict]:
    """The prompts of FILE, each {"prompt": shown text, "text": what the model reads, and
    "completion" where the file gives the expected reply}. A .jsonl file (or any file whose lines
    all start with "{") holds {"prompt": ..., ["completion": ...]} or {"messages": [...]} objects,
    rendered as training renders them (a pair through the chat template when the tokenizer has one;
    messages up to the last user turn, a final assistant turn being the expected reply); else each
    non-blank line is one prompt (with `chat`, asked as a user message). A bad line names file:line;
    unknown keys are refused by name."""
    from pathlib import Path

    from .data.chat import render_chat
    from .data.jsonl import read_jsonl

    path = Path(path)
    if not path.is_file():
        raise InputError(f"--prompts {path}: file not found")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise InputError(f"--prompts {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    body = [ln for ln in lines if ln.strip()]
    if not body:
        raise InputError(f"--prompts {path}: no prompts (the file is empty)")
    if path.suffix != ".jsonl" and not all(ln.lstrip().startswith("{") for ln in body):
        return [{"prompt": ln, "text": _chat(tokenizer, ln) if chat else ln, "chat": chat} for ln in body]
    out = []
    for n, obj in read_jsonl(path):
        where = f"{path}:{n}"
        unknown = sorted(set(obj) - set(PROMPT_KEYS))
        if unknown:
            raise InputError(f"{where}: unknown key {unknown[0]!r}; a prompt line has 'prompt' (and 'completion') "
                             f"or 'messages'")
        if "messages" in obj:
            msgs = obj["messages"]
            if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
                raise InputError(f"{where}: 'messages' must be a non-empty list of messages")
            expected = msgs[-1].get("content") if msgs[-1].get("role") == "assistant" else None
            asked = msgs[:-1] if expected is not None else msgs
            if not asked:
                raise InputError(f"{where}: no message to answer")
            row = {"prompt": asked[-1].get("content", ""), "text": render_chat(tokenizer, asked,
                                                                              add_generation_prompt=True), "chat": True}
        elif "prompt" in obj:
            if not isinstance(obj["prompt"], str):
                raise InputError(f"{where}: 'prompt' must be a string")
            expected = obj.get("completion")
            use_chat = chat or bool(tokenizer.chat_template)
            row = {"prompt": obj["prompt"], "text": _chat(tokenizer, obj["prompt"]) if use_chat else obj["prompt"],
                   "chat": use_chat}
        else:
            raise InputError(f"{where}: missing key: expected 'prompt' or 'messages'")
        if expected is not None:
            if not isinstance(expected, str):
                raise InputError(f"{where}: the expected reply must be a string")
            row["completion"] = expected
        out.append(row)
    return out


def _chat(tokenizer, prompt: str) -> str:
    from .data.chat import render_chat

    return render_chat(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)
