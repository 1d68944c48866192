"""The worker's own source text, by name: what the notebooks print to show a DDP step.

Stdlib only (never imports torch): it reads ``ddpnb/worker.py`` as text and parses it with ``ast``.
"""

from __future__ import annotations

import ast
from pathlib import Path

from .watch import PART2_BANNER  # the comment line that opens Part 2 of the worker

WORKER_PATH = Path(__file__).with_name("worker.py")


def _definitions(text: str) -> dict[str, tuple[int, int]]:
    """Top-level function and class names -> (first, last) line, 1-based, decorators included."""
    spans = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            spans[node.name] = (first, node.end_lineno)
    return spans


def worker_source(*names: str) -> str:
    """The named top-level definitions of the worker, each sliced exactly (decorators included),
    joined by one blank line. An unknown name, or none, is a ValueError listing the names."""
    text = WORKER_PATH.read_text()
    spans = _definitions(text)
    unknown = [name for name in names if name not in spans]
    if unknown or not names:
        what = f"defines no top-level {', '.join(map(repr, unknown))}" if unknown else "names"
        raise ValueError(f"{WORKER_PATH.name} {what}; name one or more of: {', '.join(spans)}.")
    lines = text.splitlines(keepends=True)
    return "\n".join("".join(lines[first - 1 : last]) for first, last in map(spans.get, names))


def worker_part1_names() -> list[str]:
    """Names of the worker's top-level definitions above the Part 2 banner, in order."""
    text = WORKER_PATH.read_text()
    banner = next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith(PART2_BANNER))
    return [name for name, (first, _) in _definitions(text).items() if first < banner]
