"""Text for the notebooks: long shell command lines one option per line, diffs of scripts."""

from __future__ import annotations

import difflib
import os
import re
import shlex
from pathlib import Path

WIDTH = 88  # longer lines are split; a notebook's output area wraps at about this width
INDENT = "    "
_ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")  # NAME=value before a command (env, export)


def _is_option(token: str) -> bool:
    return token.lstrip("'\"").startswith("-")


def _groups(tokens: list[str]) -> list[list[str]]:
    """Tokens grouped into lines: an option with its separate value (``-o X``, ``--config
    PATH``), an environment assignment, or a run of plain words (``cd DIR && exec env``)."""
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
    """``line`` split into one option per line with ``\\`` continuations when longer than
    ``width``; each part stays whole (``--master_addr=10.0.0.1``, a quoted argument), a trailing
    ``  # comment`` stays on the last line, and pasted into a shell it runs the same command."""
    if len(line) <= width or line.lstrip().startswith("#"):
        return line
    margin = line[: len(line) - len(line.lstrip())]
    command, sep, comment = line.strip().partition("  # ")
    lexer = shlex.shlex(command, posix=False)
    lexer.whitespace_split, lexer.commenters = True, ""
    try:
        tokens = list(lexer)
    except ValueError:  # unbalanced quotes: not a command line we can split safely
        return line
    lines = [" ".join(group) for group in _groups(tokens)]
    out = [margin + lines[0]] + [margin + INDENT + part for part in lines[1:]]
    out[-1] += sep + comment
    return " \\\n".join(out)


def wrap_commands(text: str, width: int = WIDTH) -> str:
    """:func:`wrap_command` on every line of ``text`` (node commands, for a notebook)."""
    return "\n".join(wrap_command(line, width) for line in text.splitlines())


def diff(before: str | os.PathLike, after: str | os.PathLike, context: int = 3, names=None) -> str:
    """The unified diff from ``before`` to ``after``: two text files, or two texts ``names``d."""
    if names is None:
        names = (str(before), str(after))
        before, after = Path(before).read_text(), Path(after).read_text()
    lines = difflib.unified_diff(
        str(before).splitlines(True), str(after).splitlines(True), *names, n=context
    )
    return "".join(lines)
