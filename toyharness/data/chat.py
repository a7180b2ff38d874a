"""Chat templates (`tokenizer.chat_template`, jinja2), rendered as transformers'
`apply_chat_template` renders them: a sandboxed environment with trim_blocks and lstrip_blocks,
the loopcontrols extension, `raise_exception` and `strftime_now` globals, a `tojson` filter that
keeps non-ASCII text, and the tokenizer's special tokens (`bos_token`, `eos_token`) as variables."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from ..errors import InputError


class TemplateError(InputError):
    """The template raised (`raise_exception`) or failed to render."""


def _raise_exception(message: str):
    raise TemplateError(f"chat template: {message}")


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2 import TemplateSyntaxError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except TemplateSyntaxError as exc:
        raise InputError(f"chat template: not valid jinja2 (line {exc.lineno}: {exc.message})") from None


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The conversation as text, through the tokenizer file's chat template."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        if tokenizer.source == "bytes":     # the recipes' default: raw bytes, no GGUF behind it
            raise InputError("the byte tokenizer has no chat template; chat data and --chat need a GGUF "
                             "tokenizer with tokenizer.chat_template (lora's base, or --set tokenizer=FILE.gguf)")
        raise InputError(f"{tokenizer.source}: has no chat template (tokenizer.chat_template); chat data and "
                         "--chat need one")
    names = {key: tokenizer.tokens[tid] if tid is not None else ""
             for key, tid in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id))}
    from jinja2 import TemplateError as JinjaError

    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **names)
    except TemplateError:
        raise
    except JinjaError as exc:
        raise InputError(f"chat template: rendering failed ({exc})") from None
