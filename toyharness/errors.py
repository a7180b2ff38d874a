"""Exceptions with a meaning for the user. The CLI maps them to exit codes (`exit_code`;
docs/design.md)."""

from __future__ import annotations


class ToyharnessError(Exception):
    """Base class. `exit_code` is what the CLI returns for it."""

    exit_code = 2


class InputError(ToyharnessError, ValueError):
    """Bad user input: options, data, files, shapes, token ids. Exit 2."""


class ShapeError(InputError):
    """A tensor or array whose shape does not fit where it is used."""


class GGUFError(InputError):
    """A GGUF file that is missing, truncated, not a GGUF, or lacks what we need."""


class BackendError(InputError):
    """An unknown backend, or one this build does not include."""


class CheckFailed(ToyharnessError):
    """A check that ran and failed (golden mismatch, NaN loss). Exit 1."""

    exit_code = 1


class WriteError(ToyharnessError):
    """A file that could not be written (disk full, quota, read-only folder, ...). Exit 1.
    Nothing is left under the final name; the previous file of that name, if any, is intact."""

    exit_code = 1

    def __init__(self, path, cause: BaseException | str):
        reason = cause if isinstance(cause, str) else (getattr(cause, "strerror", None) or str(cause))
        super().__init__(f"cannot write {path}: {reason}")
        self.path, self.reason = path, reason


class DoesNotFit(InputError):
    """A run whose memory plan exceeds what the backend has free (toyharness/engine/memory_plan.py):
    refused before anything large is allocated, with the options that would shrink it most. Exit 2."""


class OutOfMemory(ToyharnessError, MemoryError):
    """An allocation the backend refused although the plan fitted (a plan that underestimates,
    another process taking memory): one line naming the backend, the buffer and the sizes. Exit 1."""

    exit_code = 1


class RecipeError(ToyharnessError):
    """An exception other than these raised inside a recipe's hook or its options' validation:
    one line naming the recipe, the hook and the exception (the traceback with --debug). Exit 2."""

    def __init__(self, recipe: str | None, hook: str, cause: BaseException):
        reason = " ".join(str(cause).split())[:300]
        where = f"recipe {recipe}: " if recipe else ""
        super().__init__(f"{where}{hook} raised {type(cause).__name__}"
                         + (f": {reason}" if reason else "") + " (--debug shows the traceback)")
        self.recipe, self.hook, self.cause = recipe, hook, cause


class Reported(ToyharnessError):
    """A failure whose one line was already printed (a data-parallel run's process said it, or the
    launcher's supervisor did: toyharness/launcher.py); the CLI prints nothing more. Its exit code
    is the run's."""

    def __init__(self, exit_code: int):
        super().__init__(f"exit {exit_code}")
        self.exit_code = exit_code
