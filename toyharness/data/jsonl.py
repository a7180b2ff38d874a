"""JSONL data, one example a line, in the forms mlx-lm and torchtune accept:

    {"text": "..."}
    {"prompt": "...", "completion": "..."}
    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}

Prompt/completion pairs are rendered as a user and an assistant message through the chat
template when the tokenizer has one (as mlx-lm does), else as prompt + completion + EOS; chat
needs a template. With `mask_prompt` (default true) the loss counts only completion (assistant)
tokens, their end-of-turn included; `text` counts every token. The examples become rows of
t_seq positions, one example a row or packed several a row (examples.py says how); padding never
counts. The last 10% of examples are the held-out split.
"""

from __future__ import annotations

import json
import os
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputError
from .chat import render_chat
from .examples import ExampleData, TokenStore

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Example:
    ids: list[int]
    counts: list[bool]        # per id: does predicting it count in the loss


def iter_jsonl(path: Path):
    """(line number, object, the line's size in bytes) for each non-blank line, read a line at a
    time; a bad line names file:line."""
    seen = False
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                before = f.tell() - len(raw)
                raise InputError(f"{path}: not UTF-8 text ({exc.reason} at byte {before + exc.start})") from None
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
            seen = True
            yield n, obj, len(raw)
    if not seen:
        raise InputError(f"{path}: no examples (the data set is empty)")


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, object) for each non-blank line; a bad line names file:line."""
    return [(n, obj) for n, obj, _ in iter_jsonl(path)]


def _string(obj: dict, key: str, where: str) -> str:
    if key not in obj:
        raise InputError(f"{where}: missing key {key!r}")
    if not isinstance(obj[key], str):
        raise InputError(f"{where}: {key!r} must be a string, got {type(obj[key]).__name__}")
    return obj[key]


def _messages(obj: dict, where: str) -> list[dict]:
    return message_list(obj["messages"], "messages", where)


def message_list(msgs, key: str, where: str) -> list[dict]:
    """`msgs` (the value of `key`) checked as a non-empty list of {"role", "content"} messages."""
    if not isinstance(msgs, list) or not msgs:
        raise InputError(f"{where}: {key!r} must be a non-empty list")
    for k, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise InputError(f"{where}: {key}[{k}] must be an object with 'role' and 'content'")
        role, _ = _string(m, "role", f"{where}: {key}[{k}]"), _string(m, "content", f"{where}: {key}[{k}]")
        if role not in ROLES:
            raise InputError(f"{where}: {key}[{k}] has role {role!r}; allowed: {', '.join(ROLES)}")
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


def encode_file(path: Path, tokenizer, mask_prompt: bool, progress: bool = False) -> TokenStore:
    """Every example of the file as flat arrays (examples.TokenStore), line by line; with
    `progress`, a bar over the file's bytes on a terminal."""
    # growing flat buffers (5 bytes a token), not an array per example joined at the end
    ids, counts, lengths = array("i"), bytearray(), array("q")
    with _Bar(path, progress) as bar:
        for n, obj, size in iter_jsonl(path):
            ex = encode_example(obj, tokenizer, mask_prompt, f"{path}:{n}")
            ids.extend(ex.ids)
            counts.extend(bytes(ex.counts))
            lengths.append(len(ex.ids))
            bar.advance(size)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(np.frombuffer(lengths, np.int64), out=offsets[1:])
    return TokenStore(np.frombuffer(ids, np.int32) if ids else np.zeros(0, np.int32),
                      np.frombuffer(counts, np.uint8) if counts else np.zeros(0, np.uint8), offsets)


class _Bar:
    """rich progress over a file's bytes, as the runner's bar; only on a terminal."""

    def __init__(self, path: Path, enabled: bool):
        self._bar = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        console = Console(stderr=True)
        if console.is_terminal:
            self._bar = Progress(TextColumn(f"[bold]tokenizing {path.name}"), BarColumn(), DownloadColumn(),
                                 TimeRemainingColumn(), console=console, transient=True)
            self._task = self._bar.add_task("tokenize", total=path.stat().st_size)

    def __enter__(self) -> _Bar:
        if self._bar is not None:
            self._bar.start()
        return self

    def advance(self, size: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, size)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()


def load_jsonl(path: Path, tokenizer, t_seq: int, mask_prompt: bool = True, pack: bool = False,
               cache: bool = False, progress: bool = False) -> ExampleData:
    """The file's examples as rows of t_seq (examples.py says how, packed or not). With `cache`,
    the tokenized arrays and the rows' layout are kept in the user cache by the file's hash, the
    tokenizer and the options (data/cache.py), so a second load reads arrays only."""
    pad = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    if not cache:
        store = encode_file(path, tokenizer, mask_prompt, progress)
        return ExampleData(store, tokenizer.vocab_size, str(path), t_seq, pad, tokenizer.byte_level, pack)
    from .cache import cached_examples

    store, rows = cached_examples(path, tokenizer, mask_prompt, t_seq, pack,
                                  lambda: encode_file(path, tokenizer, mask_prompt, progress))
    return ExampleData(store, tokenizer.vocab_size, str(path), t_seq, pad, tokenizer.byte_level, pack, rows)
