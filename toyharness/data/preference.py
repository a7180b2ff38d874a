"""Preference pairs (DPO, ORPO), one a JSONL line, in TRL's forms:

    {"prompt": "...", "chosen": "...", "rejected": "..."}
    {"prompt": [messages], "chosen": [messages], "rejected": [messages]}
    {"chosen": [messages], "rejected": [messages]}        (implicit prompt)

Messages are {"role", "content"} objects as in chat data (data/jsonl.py). Without a `prompt`,
the prompt is the leading messages the two conversations share (TRL's extract_prompt) and each
completion the rest. Strings go through the tokenizer's chat template where it has one, as a user
turn and an assistant turn (as prompt/completion data does), else as prompt + completion + EOS;
conversations need a template.

Each side is tokenized as TRL's DPOTrainer tokenizes it: the prompt alone (rendered with the
generation prompt) and the prompt with the completion; the completion is what follows their
common prefix. A side of n ids gives k = min(n - 1, t_seq) positions: inputs ids[:k], targets
ids[1:k+1]; a side longer than t_seq + 1 ids is cut at the end and the pair counted as truncated
(as JSONL examples are), and a pair either of whose completions has no target within t_seq is
dropped. The last 10% of the pairs kept (at least one) are the held-out split.

A batch of t_batch pairs holds both sides of each pair, chosen then rejected:
``tokens`` and ``targets`` (int32), ``completion`` (f32: the target is a completion token) and
``valid`` (f32: the target is not padding), each [t_batch, 2, t_seq], and ``pairs`` (int32,
[t_batch]: each pair's index in the file's kept pairs, by which a precomputed reference is found).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputError
from .chat import render_chat
from .jsonl import iter_jsonl, message_list
from .text import EVAL_FRACTION

SIDES = ("chosen", "rejected")


@dataclass
class Side:
    ids: list[int]
    prompt_len: int           # ids before the completion


def _common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _render(tokenizer, msgs: list[dict], where: str, generation_prompt: bool = False) -> list[int]:
    try:
        return tokenizer.encode(render_chat(tokenizer, msgs, generation_prompt), add_special=False)
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None


def encode_pair(obj: dict, tokenizer, where: str) -> tuple[Side, Side]:
    """One JSONL object as its chosen and rejected sides; a bad record is refused naming `where`
    (file:line) and the key."""
    for key in SIDES:
        if key not in obj:
            raise InputError(f"{where}: missing key {key!r} (a preference pair has 'chosen' and 'rejected', "
                             "and 'prompt' unless both are conversations)")
    unknown = sorted(set(obj) - {"prompt", *SIDES})
    if unknown:
        raise InputError(f"{where}: unknown key {unknown[0]!r}; a preference pair has 'prompt', 'chosen', 'rejected'")
    chosen, rejected = obj["chosen"], obj["rejected"]
    if isinstance(chosen, str) or isinstance(rejected, str):
        for key in ("prompt", *SIDES):
            if key not in obj:
                raise InputError(f"{where}: missing key {key!r} (text pairs need 'prompt', 'chosen' and 'rejected')")
            if not isinstance(obj[key], str):
                raise InputError(f"{where}: {key!r} must be a string like the others, got {type(obj[key]).__name__}")
        return _text_pair(obj["prompt"], chosen, rejected, tokenizer, where)
    for key in SIDES:
        if not isinstance(obj[key], list):
            raise InputError(f"{where}: {key!r} must be a string or a list of messages, got {type(obj[key]).__name__}")
        message_list(obj[key], key, where)
    if "prompt" in obj:
        if not isinstance(obj["prompt"], list):
            raise InputError(f"{where}: 'prompt' must be a list of messages like 'chosen' and 'rejected', got "
                             f"{type(obj['prompt']).__name__}")
        prompt = message_list(obj["prompt"], "prompt", where)
    else:   # the shared leading messages (TRL's extract_prompt)
        n = _common_prefix(chosen, rejected)
        if n == 0:
            raise InputError(f"{where}: missing key 'prompt', and 'chosen' and 'rejected' share no leading message to "
                             "take as the prompt")
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    for key, msgs in zip(SIDES, (chosen, rejected)):
        if not msgs:
            raise InputError(f"{where}: {key!r} has no message after the prompt: nothing to score")
    prompt_ids = _render(tokenizer, prompt, where, generation_prompt=True)
    sides = [_render(tokenizer, prompt + msgs, where) for msgs in (chosen, rejected)]
    return _sides(prompt_ids, sides, where)


def _text_pair(prompt: str, chosen: str, rejected: str, tokenizer, where: str) -> tuple[Side, Side]:
    if tokenizer.chat_template:     # as prompt/completion data: a user turn and an assistant turn
        user = [{"role": "user", "content": prompt}]
        prompt_ids = _render(tokenizer, user, where, generation_prompt=True)
        sides = [_render(tokenizer, user + [{"role": "assistant", "content": c}], where) for c in (chosen, rejected)]
        return _sides(prompt_ids, sides, where)
    prompt_ids = tokenizer.encode(prompt, add_special=True)
    sides = []
    for completion in (chosen, rejected):
        ids = tokenizer.encode(prompt + completion, add_special=True)
        if tokenizer.eos_id is not None and (not ids or ids[-1] != tokenizer.eos_id):
            ids.append(tokenizer.eos_id)
        sides.append(ids)
    return _sides(prompt_ids, sides, where)


def _sides(prompt_ids: list[int], sides: list[list[int]], where: str) -> tuple[Side, Side]:
    # the completion starts where the prompt alone and prompt + completion part (TRL's prompt_len)
    prompt_len = min(_common_prefix(prompt_ids, ids) for ids in sides)
    out = []
    for key, ids in zip(SIDES, sides):
        if len(ids) <= prompt_len:
            raise InputError(f"{where}: {key!r} gives no token after the prompt: nothing to score")
        out.append(Side(ids, prompt_len))
    return out[0], out[1]


class PreferenceData:
    """Pairs as batches of t_batch pairs, both sides of each (the module's docstring says how)."""

    masked = True
    packed = False
    preference = True

    def __init__(self, pairs: list[tuple[Side, Side]], vocab: int, source: str, t_seq: int, pad_id: int,
                 byte_level: bool = False):
        self.vocab, self.source, self.t_seq, self.pad_id, self.byte_level = vocab, source, t_seq, pad_id, byte_level
        top = max((max(s.ids) for pair in pairs for s in pair), default=0)
        if top >= vocab:
            raise InputError(f"data {source}: token id {top} is outside the vocabulary of {vocab}")
        kept, self.truncated = [], 0
        for pair in pairs:
            self.truncated += any(len(s.ids) - 1 > t_seq for s in pair)
            # a completion with no target within t_seq scores nothing
            if all(min(len(s.ids) - 1, t_seq) > s.prompt_len - 1 for s in pair):
                kept.append(pair)
        self.dropped = len(pairs) - len(kept)
        if not kept:
            raise InputError(f"data {source}: no pair has a completion token within t_seq={t_seq}")
        n = len(kept)
        self.n_eval = max(1, int(round(n * EVAL_FRACTION))) if n > 1 else 0
        self.n_train = n - self.n_eval
        self.n_pairs = n
        # every kept pair's rows, [n, 2, t_seq]: small next to a model (4 arrays of 4 bytes a position)
        shape = (n, 2, t_seq)
        self.tokens = np.full(shape, pad_id, np.int32)
        self.targets = np.full(shape, pad_id, np.int32)
        self.completion = np.zeros(shape, np.float32)
        self.valid = np.zeros(shape, np.float32)
        for i, pair in enumerate(kept):
            for j, s in enumerate(pair):
                k = min(len(s.ids) - 1, t_seq)
                ids = np.asarray(s.ids, np.int32)
                self.tokens[i, j, :k] = ids[:k]
                self.targets[i, j, :k] = ids[1:k + 1]
                self.valid[i, j, :k] = 1.0
                # target t is ids[t + 1]: a completion token from index prompt_len on
                self.completion[i, j, max(s.prompt_len - 1, 0):k] = 1.0

    def summary(self) -> str:
        dropped = f" ({self.dropped} had no completion token within t_seq and were dropped)" if self.dropped else ""
        return (f"data {self.source}: {self.n_pairs} preference pairs ({self.n_train} train, {self.n_eval} held out), "
                f"{self.truncated} truncated to t_seq={self.t_seq}{dropped}")

    def check(self, options) -> None:
        if options.t_seq != self.t_seq:
            raise InputError(f"data {self.source}: made for t_seq={self.t_seq}, the run has {options.t_seq}")
        if self.n_train < 1 or self.n_eval < 1:
            raise InputError(f"data {self.source}: needs at least 2 preference pairs (train and held out), has "
                             f"{self.n_pairs}")

    def pick(self, split: str, index: int, options) -> np.ndarray:
        """The pairs of batch `index`: train pairs drawn by (seed, index); held-out pairs in order."""
        if split == "train":
            return np.random.default_rng([options.seed, 0, index]).integers(0, self.n_train, size=options.t_batch)
        if split == "eval":
            return self.n_train + (index * options.t_batch + np.arange(options.t_batch)) % self.n_eval
        raise InputError(f"unknown split {split!r}; allowed: train, eval")

    def rows(self, pick: np.ndarray) -> dict[str, np.ndarray]:
        return {"tokens": self.tokens[pick], "targets": self.targets[pick], "completion": self.completion[pick],
                "valid": self.valid[pick], "pairs": np.asarray(pick, np.int32)}

    def step_batch(self, split: str, index: int, options) -> dict[str, np.ndarray]:
        return self.rows(self.pick(split, index, options))

    def eval_batches(self, options) -> int:
        return -(-self.n_eval // options.t_batch)

    def items_per_batch(self, options) -> int:
        return 2 * options.t_batch * options.t_seq


def load_preference_data(path: str | Path, tokenizer, t_seq: int) -> PreferenceData:
    """A JSONL file of preference pairs (the module's docstring has the forms) as batches of pairs,
    tokenized with `tokenizer` (a GGUF's, or bytes); a bad line is refused naming file:line."""
    path = Path(path).expanduser()
    if path.suffix != ".jsonl":
        raise InputError(f"data {str(path)!r}: preference pairs are a .jsonl file ({{\"prompt\", \"chosen\", "
                         "\"rejected\"}} a line)")
    if not path.is_file():
        raise InputError(f"data {str(path)!r}: no such file")
    pairs = [encode_pair(obj, tokenizer, f"{path}:{n}") for n, obj, _ in iter_jsonl(path)]
    pad = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    return PreferenceData(pairs, tokenizer.vocab_size, str(path), t_seq, pad, tokenizer.byte_level)
