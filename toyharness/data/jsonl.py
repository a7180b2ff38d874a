"""JSONL data, one example a line, in the forms mlx-lm and torchtune accept:

    {"text": "..."}
    {"prompt": "...", "completion": "..."}
    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}

Prompt/completion pairs are rendered as a user and an assistant message through the chat
template when the tokenizer has one (as mlx-lm does), else as prompt + completion + EOS; chat
needs a template. With `mask_prompt` (default true) the loss counts only completion (assistant)
tokens, their end-of-turn included; `text` counts every token. Each example becomes one row of
t_seq positions, cut at the end when longer (counted as truncated) and padded when shorter;
padding never counts. The last 10% of examples are the held-out split.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputError
from .chat import render_chat
from .text import EVAL_FRACTION

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Example:
    ids: list[int]
    counts: list[bool]        # per id: does predicting it count in the loss


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, object) for each non-blank line; a bad line names file:line."""
    rows = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{n}: not JSON ({exc.msg})") from None
        except RecursionError:
            raise InputError(f"{path}:{n}: JSON nested too deeply") from None
        if not isinstance(obj, dict):
            raise InputError(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
        rows.append((n, obj))
    if not rows:
        raise InputError(f"{path}: no examples (the data set is empty)")
    return rows


def _string(obj: dict, key: str, where: str) -> str:
    if key not in obj:
        raise InputError(f"{where}: missing key {key!r}")
    if not isinstance(obj[key], str):
        raise InputError(f"{where}: {key!r} must be a string, got {type(obj[key]).__name__}")
    return obj[key]


def _messages(obj: dict, where: str) -> list[dict]:
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise InputError(f"{where}: 'messages' must be a non-empty list")
    for k, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise InputError(f"{where}: messages[{k}] must be an object with 'role' and 'content'")
        role, _ = _string(m, "role", f"{where}: messages[{k}]"), _string(m, "content", f"{where}: messages[{k}]")
        if role not in ROLES:
            raise InputError(f"{where}: messages[{k}] has role {role!r}; allowed: {', '.join(ROLES)}")
    return msgs


def _span(tokenizer, counts: list[bool], ids: list[int], text: str, add_special: bool, count: bool) -> None:
    piece = tokenizer.encode(text, add_special=add_special) if text else []
    ids.extend(piece)
    counts.extend([count] * len(piece))


def encode_example(obj: dict, tokenizer, mask_prompt: bool, where: str) -> Example:
    """One JSONL object as ids and per-id loss flags."""
    kinds = [k for k in ("messages", "prompt", "text") if k in obj]
    if not kinds:
        raise InputError(f"{where}: missing key: expected 'text', 'prompt' and 'completion', or 'messages'")
    kind = kinds[0]
    if kind == "text":
        ids = tokenizer.encode(_string(obj, "text", where), add_special=True)
        if tokenizer.eos_id is not None and (not ids or ids[-1] != tokenizer.eos_id):
            ids.append(tokenizer.eos_id)
        return Example(ids, [True] * len(ids))
    if kind == "prompt":
        prompt, completion = _string(obj, "prompt", where), _string(obj, "completion", where)
        if tokenizer.chat_template:
            msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            return _chat_example(msgs, tokenizer, mask_prompt, where)
        ids: list[int] = []
        counts: list[bool] = []
        _span(tokenizer, counts, ids, prompt, True, not mask_prompt)
        _span(tokenizer, counts, ids, completion, False, True)
        if tokenizer.eos_id is not None:
            ids.append(tokenizer.eos_id)
            counts.append(True)
        return Example(ids, counts)
    return _chat_example(_messages(obj, where), tokenizer, mask_prompt, where)


def _chat_example(msgs: list[dict], tokenizer, mask_prompt: bool, where: str) -> Example:
    """The whole conversation's ids; with mask_prompt only each assistant turn counts: its content
    and the markup that closes it, found in the conversation as rendered whole.

    A turn is located in the whole rendering, never taken from a rendering of the conversation
    cut after it: templates render the last turn their own way (Qwen3 adds an empty
    <think></think> to assistant turns after the last user turn, Gemma 4's generation prompt an
    empty thought channel), so a cut rendering is not a prefix of the whole. The closing markup is
    what follows the content in the cut rendering, as far as the whole one agrees. Token positions
    are the lengths of the rendering's prefixes encoded, checked to be prefixes of the whole's
    ids; where any of this fails the example is refused by name, never masked wrongly."""
    try:
        text = render_chat(tokenizer, msgs)
        full = tokenizer.encode(text, add_special=False)
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None
    if not mask_prompt:
        return Example(full, [True] * len(full))
    if not any(m["role"] == "assistant" for m in msgs):
        raise InputError(f"{where}: no assistant message: nothing for the loss to count (or set mask_prompt=false)")

    def token_position(chars: int, turn: int) -> int:
        ids = tokenizer.encode(text[:chars], add_special=False)
        if full[:len(ids)] != ids:
            raise InputError(f"{where}: assistant turn {turn}: the conversation's ids do not split where the turn "
                             "begins or ends (the tokenizer merges across it); set mask_prompt=false")
        return len(ids)

    counts = [False] * len(full)
    cursor = 0
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = render_chat(tokenizer, msgs[:i]) if i else ""
        cursor = max(cursor, len(os.path.commonprefix([text, before])))
        content = m["content"]
        if not content.strip():
            raise InputError(f"{where}: assistant turn {i} is empty: nothing of it to count; set mask_prompt=false "
                             "or drop the turn")
        begin = text.find(content, cursor)
        alone = render_chat(tokenizer, msgs[:i + 1])
        at = alone.rfind(content)
        if begin < 0 or at < 0:
            raise InputError(f"{where}: assistant turn {i}: its content is not where the chat template renders the "
                             "conversation; set mask_prompt=false")
        closing = os.path.commonprefix([alone[at + len(content):], text[begin + len(content):]])
        stop = begin + len(content) + len(closing)
        for j in range(token_position(begin, i), token_position(stop, i)):
            counts[j] = True
        cursor = stop
    return Example(full, counts)


class ExampleData:
    """Examples as fixed rows: `tokens`, `targets` (int32) and `mask` (float32), [n, t_seq]."""

    masked = True
    byte_level = False

    def __init__(self, examples: list[Example], vocab: int, source: str, t_seq: int, pad_id: int,
                 byte_level: bool = False):
        self.vocab, self.source, self.t_seq, self.byte_level = vocab, source, t_seq, byte_level
        n = len(examples)
        tokens = np.full((n, t_seq), pad_id, np.int32)
        targets = np.full((n, t_seq), pad_id, np.int32)
        mask = np.zeros((n, t_seq), np.float32)
        self.truncated = 0
        for r, ex in enumerate(examples):
            ids = np.asarray(ex.ids, np.int64)
            if len(ids) - 1 > t_seq:
                self.truncated += 1
            k = min(len(ids) - 1, t_seq)
            if k <= 0:
                continue
            tokens[r, :k] = ids[:k]
            targets[r, :k] = ids[1:k + 1]
            mask[r, :k] = np.asarray(ex.counts[1:k + 1], np.float32)
        keep = mask.sum(1) > 0
        self.dropped = int(n - keep.sum())
        self.tokens, self.targets, self.mask = tokens[keep], targets[keep], mask[keep]
        if len(self.tokens) == 0:
            raise InputError(f"data {source}: no example has a token that counts within t_seq={t_seq}")
        n = len(self.tokens)
        self.n_eval = max(1, int(round(n * EVAL_FRACTION))) if n > 1 else 0
        self.n_train = n - self.n_eval
        top = int(max(self.tokens.max(), self.targets.max()))
        if top >= vocab:
            raise InputError(f"data {source}: token id {top} is outside the vocabulary of {vocab}")

    def summary(self) -> str:
        dropped = f" ({self.dropped} of them counted nothing within t_seq and were dropped)" if self.dropped else ""
        return (f"data {self.source}: {len(self.tokens)} examples ({self.n_train} train, {self.n_eval} held out), "
                f"{self.truncated} truncated to t_seq={self.t_seq}{dropped}")

    def check(self, options) -> None:
        if options.t_seq != self.t_seq:
            raise InputError(f"data {self.source}: made for t_seq={self.t_seq}, the run has {options.t_seq}")
        if self.n_train < 1 or self.n_eval < 1:
            raise InputError(f"data {self.source}: needs at least 2 examples (train and held out), has "
                             f"{len(self.tokens)}")

    def _rows(self, split: str) -> slice:
        if split == "train":
            return slice(0, self.n_train)
        if split == "eval":
            return slice(self.n_train, self.n_train + self.n_eval)
        raise InputError(f"unknown split {split!r}; allowed: train, eval")

    def step_batch(self, split: str, index: int, options) -> dict[str, np.ndarray]:
        """Batch `index` of a split: train rows drawn by (seed, index); held-out rows in order."""
        rows = self._rows(split)
        n = rows.stop - rows.start
        if split == "train":
            pick = np.random.default_rng([options.seed, 0, index]).integers(0, n, size=options.t_batch)
        else:
            pick = (index * options.t_batch + np.arange(options.t_batch)) % n
        pick = pick + rows.start
        return {"tokens": self.tokens[pick], "targets": self.targets[pick], "mask": self.mask[pick]}

    def eval_batches(self, options) -> int:
        return -(-self.n_eval // options.t_batch)

    def items_per_batch(self, options) -> int:
        return options.t_batch * options.t_seq

    def eval_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        s = self._rows("eval")
        return self.tokens[s], self.targets[s], self.mask[s]


def load_jsonl(path: Path, tokenizer, t_seq: int, mask_prompt: bool = True) -> ExampleData:
    examples = [encode_example(obj, tokenizer, mask_prompt, f"{path}:{n}") for n, obj in read_jsonl(path)]
    pad = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    return ExampleData(examples, tokenizer.vocab_size, str(path), t_seq, pad, byte_level=tokenizer.byte_level)
