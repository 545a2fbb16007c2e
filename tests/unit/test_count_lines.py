"""scripts/count_lines.py: wc -l and code-line counts of core and app, and its budget check."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "count_lines.py"

# 12 lines: docstring 3, blank 2, comment-only 2, code 5 (a trailing comment and a "#" inside a
# string do not make a line a comment; a non-docstring string is code).
MODULE = '''"""A module docstring
over three lines.
"""
import os  # a comment after code

# a comment line
    # an indented comment line
HASH = "# not a comment"
TEXT = """not a docstring"""

def f() -> None:
    return None
'''
# 7 lines: a function and a class docstring (one line each), a blank line, 4 code lines
FUNCTIONS = '''def g() -> int:
    """g's docstring."""
    return 1

class C:
    """C's docstring."""
    x = 1
'''


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("count_lines", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    files = {
        "pskv/__init__.py": MODULE,
        "pskv/ps/__init__.py": "",
        "pskv/ps/a.py": FUNCTIONS,
        "pskv/ps/b.py": MODULE,
        "pskv/app/__init__.py": '"""The app."""\n',
        "pskv/app/train.py": FUNCTIONS,
        "pskv/app/sub/deep.py": MODULE,  # counted with its app module group pskv/app/sub
        "pskv/notes.txt": "not python\n" * 50,
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_code_lines_leave_out_blanks_comments_and_docstrings() -> None:
    count_lines = load_script()
    assert count_lines.wc_lines(MODULE) == 12 and count_lines.code_lines(MODULE) == 5
    assert count_lines.wc_lines(FUNCTIONS) == 7 and count_lines.code_lines(FUNCTIONS) == 4
    assert count_lines.wc_lines("x = 1") == 0 and count_lines.code_lines("x = 1") == 1  # as wc -l: no newline


def test_groups_and_totals(tree: Path) -> None:
    totals = load_script().count(tree)
    assert totals == {
        "core": {"pskv/__init__.py": (12, 5), "pskv/ps": (0 + 7 + 12, 0 + 4 + 5)},
        "app": {"pskv/app/__init__.py": (1, 0), "pskv/app/train.py": (7, 4), "pskv/app/sub": (12, 5)},
    }


def run(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, timeout=60)


def test_prints_both_parts_and_passes_under_budget(tree: Path) -> None:
    res = run(tree)
    assert res.returncode == 0 and res.stderr == "", res
    lines = res.stdout.splitlines()
    assert lines[0] == "core (budget 6000 lines by wc -l)"
    assert lines[1].split() == ["wc", "-l", "code"]
    assert lines[2].split() == ["pskv/__init__.py", "12", "5"] and lines[3].split() == ["pskv/ps", "19", "9"]
    assert lines[4].split() == ["total", "31", "14"]
    assert "app (budget 900 lines by wc -l)" in lines
    assert lines[-1].split() == ["total", "20", "9"]


def test_fails_naming_what_is_over_budget(tree: Path) -> None:
    (tree / "pskv" / "app" / "big.py").write_text("x = 1\n" * 881)  # app: 20 + 881 = 901 lines
    res = run(tree)
    assert res.returncode == 1
    assert res.stderr == "over budget: app has 901 lines, 1 over its budget of 900\n", res
    (tree / "pskv" / "app" / "big.py").write_text("x = 1\n" * 880)  # exactly 900: within the budget
    assert run(tree).returncode == 0
