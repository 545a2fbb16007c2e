#!/usr/bin/env python3
"""Line counts of pskv's core and of its training application, against their budgets.

    python scripts/count_lines.py [ROOT]        # ROOT: the repository (default: this script's)

The core is every ``.py`` file under ``pskv/`` outside ``pskv/app/``; the app is ``pskv/app/``. For
each core group (a subpackage such as ``pskv/ps``, or a module such as ``pskv/trainer.py``) and each
app module it prints the lines as ``wc -l`` counts them and the code lines alone: no blank lines, no
lines that hold only a comment, no docstring lines. The budgets count ``wc -l`` lines; over one, the
script names what is over and exits 1. Standard library only, so CI can run it before installing.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

BUDGETS = {"core": 6000, "app": 900}  # wc -l lines


def code_lines(source: str) -> int:
    """Lines that hold code: not blank, not only a comment, not part of a docstring."""
    lines = source.splitlines()
    skipped = {number for number, line in enumerate(lines, 1) if not line.strip()}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        # A comment token on a line that starts with "#" is the whole line; "#" inside a string is
        # no comment token, and a comment after code leaves the line a code line.
        if token.type == tokenize.COMMENT and lines[token.start[0] - 1].lstrip().startswith("#"):
            skipped.add(token.start[0])
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = node.body[0] if node.body else None  # a docstring is a first statement that is a string
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            skipped.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return len(lines) - len(skipped)


def wc_lines(source: str) -> int:
    """What ``wc -l`` prints: the number of newline characters."""
    return source.count("\n")


def count(root: Path) -> dict[str, dict[str, tuple[int, int]]]:
    """{"core": {group: (wc -l, code lines)}, "app": {group: ...}} for ``root/pskv``.

    A core group is a top-level module (``pskv/trainer.py``) or subpackage (``pskv/ps``); the app,
    itself one subpackage, is shown module by module (``pskv/app/train.py``).
    """
    package = root / "pskv"
    totals: dict[str, dict[str, tuple[int, int]]] = {"core": {}, "app": {}}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).parts
        part = "app" if parts[0] == "app" else "core"
        group = "/".join(("pskv", *parts[:2])) if part == "app" else f"pskv/{parts[0]}"
        source = path.read_text(encoding="utf-8")
        wc, code = totals[part].get(group, (0, 0))
        totals[part][group] = (wc + wc_lines(source), code + code_lines(source))
    return totals


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent
    over = []
    for part, groups in count(root).items():
        wc = sum(w for w, _ in groups.values())
        code = sum(c for _, c in groups.values())
        print(f"{part} (budget {BUDGETS[part]} lines by wc -l)")
        print(f"  {'':28}{'wc -l':>8}{'code':>8}")
        for group, (group_wc, group_code) in sorted(groups.items()):
            print(f"  {group:28}{group_wc:>8}{group_code:>8}")
        print(f"  {'total':28}{wc:>8}{code:>8}")
        if wc > BUDGETS[part]:
            over.append(f"{part} has {wc} lines, {wc - BUDGETS[part]} over its budget of {BUDGETS[part]}")
    for line in over:
        print(f"over budget: {line}", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
