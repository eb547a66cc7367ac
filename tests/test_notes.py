"""`[Note: X]` comments (docs/contributing.md): each is defined once, at the top of the module that
owns it (in its module docstring or a comment block right after it), and every use elsewhere says
`See [Note: X]`. A Markdown page may mention a note in prose; it must exist.

A definition is an occurrence not preceded by "see"; a reference is one that is. The checks:
every note has exactly one definition, every definition sits at its module's top, and every
reference (and every mention in docs) names a defined note.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("fusedzero", "kernels", "tests", "bench")
DOC_FILES = ("README.md", "docs", "bench/README.md", "bench/REPORT.md")


_NOTE = re.compile(r"\[Note:\s+([^\]]+?)\]", re.DOTALL)
_SEE = re.compile(r"\bsee\s*$", re.IGNORECASE)


class Mention(NamedTuple):
    path: str  # relative to the repository root
    line: int
    name: str
    see: bool  # a reference ("See [Note: X]"), else a definition


def _name(raw: str) -> str:
    """The note's name with line breaks, comment markers and indentation folded to one space."""
    return " ".join(raw.replace("#", " ").split())


def mentions(path: Path, text: str) -> list[Mention]:
    """Every `[Note: X]` in `text`; `[Note: ...]` is the notation itself, not a note."""
    rel = path.relative_to(ROOT).as_posix()
    out = []
    for m in _NOTE.finditer(text):
        if m.group(1) == "...":
            continue
        before = " ".join(text[max(0, m.start() - 40) : m.start()].replace("#", " ").split())
        out.append(
            Mention(
                rel,
                text.count("\n", 0, m.start()) + 1,
                _name(m.group(1)),
                bool(_SEE.search(before)),
            )
        )
    return out


def top_lines(text: str) -> int:
    """The last line of a module's top: its docstring and the comments right after it, up to
    the first statement that is not the docstring."""
    body = ast.parse(text).body
    first = body[0] if body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        body = body[1:]
    return body[0].lineno - 1 if body else text.count("\n") + 1


def _code_files() -> list[Path]:
    return sorted(
        p
        for d in CODE_DIRS
        for p in (ROOT / d).rglob("*.py")
        if ".venv" not in p.parts and "results" not in p.parts
    )


def _doc_files() -> list[Path]:
    out = []
    for d in DOC_FILES:
        p = ROOT / d
        out += sorted(p.rglob("*.md")) if p.is_dir() else [p] if p.exists() else []
    return out


def problems() -> list[str]:
    defs: dict[str, list[Mention]] = defaultdict(list)
    refs: list[Mention] = []
    bad: list[str] = []
    for path in _code_files():
        if path == Path(__file__).resolve():
            continue  # this file's messages and examples are not notes
        text = path.read_text()
        found = mentions(path, text)
        if not found:
            continue
        rel = path.relative_to(ROOT).as_posix()
        top = top_lines(text)
        for m in found:
            if m.see:
                refs.append(m)
            else:
                defs[m.name].append(m)
                if m.line > top:
                    bad.append(
                        f"{rel}:{m.line}: [Note: {m.name}] is defined below the module's "
                        f"top (line {top}): move it into the module docstring or the "
                        "comment block after it, or write `See [Note: ...]` for a use"
                    )
    for name, ds in sorted(defs.items()):
        if len(ds) > 1:
            where = ", ".join(f"{d.path}:{d.line}" for d in ds)
            bad.append(
                f"[Note: {name}] is defined {len(ds)} times ({where}): keep the one at "
                "the top of the module that owns it and write `See [Note: ...]` for "
                "the others"
            )
    defined = set(defs)
    for m in refs:
        if m.name not in defined:
            bad.append(f"{m.path}:{m.line}: See [Note: {m.name}] names no defined note")
    for path in _doc_files():
        for m in mentions(path, path.read_text()):
            if m.name not in defined:
                bad.append(f"{m.path}:{m.line}: [Note: {m.name}] names no defined note")
    return bad


def test_every_note_is_defined_once_at_a_module_top_and_every_use_resolves() -> None:
    bad = problems()
    assert not bad, "\n".join(bad)


def test_the_checker_tells_definitions_from_references(tmp_path: Path) -> None:
    text = (
        '"""Doc.\n\n[Note: alpha] What it is.\n"""\n# [Note: beta\n# split] More.\n'
        "import os\n\n\ndef f() -> None:\n"
        "    # See [Note: alpha]; see\n    # [Note: beta split]\n"
        "    # [Note: gamma] defined in a body\n    pass\n"
    )
    found = mentions(ROOT / "x.py", text)
    assert [(m.name, m.see, m.line) for m in found] == [
        ("alpha", False, 3),
        ("beta split", False, 5),
        ("alpha", True, 11),
        ("beta split", True, 12),
        ("gamma", False, 13),
    ]
    assert top_lines(text) == 6
