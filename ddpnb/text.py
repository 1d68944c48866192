"""Text for the notebooks: long shell command lines one option per line, diffs of scripts, and
the check of a "predict, then run" exercise."""

from __future__ import annotations

import dataclasses
import difflib
import html
import os
import re
import shlex
from pathlib import Path

WIDTH = 88  # longer lines are split; a notebook's output area wraps at about this width
_ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")  # NAME=value before a command (env, export)


def _is_option(token: str) -> bool:
    return token.lstrip("'\"").startswith("-")


def _groups(tokens: list[str]) -> list[list[str]]:
    """Tokens grouped into lines: an option with its separate value, an assignment, plain words."""
    groups: list[list[str]] = []
    for token in tokens:
        prev = groups[-1][-1] if groups else None
        if prev is None or _is_option(token):
            groups.append([token])
        elif _is_option(prev) and "=" not in prev:  # the option's separate value
            groups[-1].append(token)
        elif _ENV.match(token) or _is_option(prev) or _ENV.match(prev):
            groups.append([token])  # an assignment; what follows --a=b or the assignments
        else:
            groups[-1].append(token)
    return groups


def wrap_command(line: str, width: int = WIDTH) -> str:
    """``line`` split one option per line with ``\\`` continuations when longer than ``width``;
    pasted into a shell it runs the same command (a trailing ``  # comment`` stays last)."""
    if len(line) <= width or line.lstrip().startswith("#"):
        return line
    margin = line[: len(line) - len(line.lstrip())]
    command, sep, comment = line.strip().partition("  # ")
    try:
        tokens = shlex.split(command, posix=False)
    except ValueError:  # unbalanced quotes: not a command line we can split safely
        return line
    lines = [" ".join(group) for group in _groups(tokens)]
    return margin + f" \\\n{margin}    ".join(lines) + sep + comment


def wrap_commands(text: str, width: int = WIDTH) -> str:
    """:func:`wrap_command` on every line of ``text`` (node commands, for a notebook)."""
    return "\n".join(wrap_command(line, width) for line in text.splitlines())


def diff(before: str | os.PathLike, after: str | os.PathLike, context: int = 3, names=None) -> str:
    """The unified diff from ``before`` to ``after``: two text files, or two texts ``names``d."""
    if names is None:
        names = (str(before), str(after))
        before, after = Path(before).read_text(), Path(after).read_text()
    texts = (str(before).splitlines(True), str(after).splitlines(True))
    return "".join(difflib.unified_diff(*texts, *names, n=context))


@dataclasses.dataclass(frozen=True, repr=False)
class Prediction:
    """A learner's prediction against what the run measured (a notebook shows it in colour)."""

    what: str
    predicted: object  # None: not made yet
    measured: object

    @property
    def verdict(self) -> str:
        if self.predicted is None:
            return (
                "no prediction yet: write it in the exercise's cell, run that cell, then this one"
            )
        if self.predicted == self.measured:
            return "right"
        return "not what the run measured: the hint below says where to look"

    def __str__(self) -> str:
        return (
            f"{self.what}: predicted {self.predicted!r}, measured {self.measured!r}: {self.verdict}"
        )

    __repr__ = __str__  # what a notebook shows as text (papermill's outputs, a terminal)

    def _repr_html_(self) -> str:
        kind = (
            "none" if self.predicted is None else "ok" if self.predicted == self.measured else "bad"
        )
        return f"<p>{badge(str(self), kind)}</p>"


BADGE_COLORS = {"ok": "#2e7d32", "bad": "#c62828", "none": "#757575"}  # green, red, grey


def badge(text: str, kind: str) -> str:
    """``text`` (escaped) on a coloured label: ``kind`` "ok", "bad" or "none" (not checked)."""
    style = f"padding:2px 8px;border-radius:3px;color:white;background:{BADGE_COLORS[kind]}"
    return f"<span style='{style}'>{html.escape(text)}</span>"


def check_prediction(what: str, predicted: object, measured: object) -> Prediction:
    """A "predict, then run" exercise's check: ``predicted`` (None: not made yet) against the
    value the run ``measured``; right when they are equal."""
    return Prediction(what, predicted, measured)
