"""The public API (docs/api.md): every public module lists its names in `__all__`, every name
there exists, and docs/api.md names each one, so the page and the code cannot drift apart. What is
not API is private by name (a `_` in its dotted name), and tests that import it say so."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = (
    "fusedzero",
    "fusedzero.policy",
    "fusedzero.optim",
    "fusedzero.checkpoint",
    "fusedzero.checkpoint.dcp",
    "fusedzero.checkpoint.hf",
    "fusedzero.kernels",
    "fusedzero.plan",
    "fusedzero.emulate",
    "fusedzero.emulate_ckpt",
    "fusedzero.testing",
    "fusedzero.stage",
    "fusedzero.state",
    "fusedzero.rules",
    "fusedzero.memory_modes",
    "fusedzero.wire",
)
# Listed in __all__ for import-star and tools; the page describes these modules as a whole.
NOT_NAMED = {"fusedzero": {"__version__"}, "fusedzero.memory_modes": None, "fusedzero.wire": None}


@pytest.mark.parametrize("name", PUBLIC)
def test_public_modules_list_existing_names_that_docs_api_md_names(name: str) -> None:
    module = importlib.import_module(name)
    names = getattr(module, "__all__", None)
    assert names, f"{name} has no __all__: list its public names"
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ lists {missing}, which {name} does not define"
    page = (ROOT / "docs" / "api.md").read_text()
    assert f"`{name}" in page or name == "fusedzero.optim", f"docs/api.md does not name {name}"
    skip = NOT_NAMED.get(name, set())
    if skip is None:
        return
    unnamed = [n for n in names if n not in skip and not re.search(rf"\b{re.escape(n)}\b", page)]
    assert not unnamed, f"docs/api.md does not name {name}'s {unnamed}"


# Modules of the command line, not library API: docs/api.md names them under "Not library API".
APPLICATION = ("fusedzero.cli", "fusedzero.app")
# Drop-ins that import their framework (seconds): their __all__ is read from the source.
DROP_INS = ("fusedzero.integrations.hf", "fusedzero.integrations.lightning")
INTERNAL = re.compile(r"About (?:an internal|internals): ([^\n]+(?:\n[^\n]+)*)")


def _modules() -> list[str]:
    """Every module of the installed package (kernels/ installs as fusedzero.kernels)."""
    names = []
    for folder, dotted in (
        (ROOT / "fusedzero", "fusedzero"),
        (ROOT / "kernels", "fusedzero.kernels"),
    ):
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            names.append(".".join((dotted, *parts[: -1 if parts[-1] == "__init__" else None])))
    return names


def _private(name: str) -> bool:
    return any(part.startswith("_") for part in name.split("."))


def test_every_public_module_is_listed_in_docs_api_md() -> None:
    """A module without a leading underscore anywhere in its name is API: docs/api.md names it
    (a private one may change without notice; start its name with `_`)."""
    page = (ROOT / "docs" / "api.md").read_text()
    unlisted = [
        m
        for m in _modules()
        if not _private(m)
        and m not in PUBLIC + DROP_INS
        and not m.startswith(tuple(a + "." for a in APPLICATION))
        and m not in APPLICATION
        and m != "fusedzero.integrations"
    ]
    assert not unlisted, (
        f"{unlisted} are public by name but not API: start their names with `_`, "
        "or add them to PUBLIC and docs/api.md"
    )
    for name in DROP_INS + APPLICATION + ("fusedzero.integrations",):
        assert f"`{name}" in page, f"docs/api.md does not name {name}"


@pytest.mark.parametrize("name", DROP_INS)
def test_drop_ins_list_names_that_docs_api_md_names(name: str) -> None:
    path = ROOT / Path(*name.split(".")).with_suffix(".py")
    found = [
        node.value
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", None) == "__all__" for t in node.targets)
    ]
    assert found, f"{name} has no __all__: list its public names"
    page = (ROOT / "docs" / "api.md").read_text()
    unnamed = [n for n in ast.literal_eval(found[0]) if not re.search(rf"\b{n}\b", page)]
    assert not unnamed, f"docs/api.md does not name {name}'s {unnamed}"


def _private_imports(tree: ast.Module, modules: set[str]) -> set[str]:
    """The private modules a test imports, or reaches as `ck._manifest` through a package."""
    found, bound = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("fusedzero")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fusedzero"):
            named = {f"{node.module}.{a.name}": a.asname or a.name for a in node.names}
            found |= {node.module} | (named.keys() & modules)
            bound |= {alias: name for name, alias in named.items() if name in modules}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            found |= {f"{bound.get(node.value.id)}.{node.attr}"} & modules
    return {m for m in found if _private(m)}


def test_tests_of_internals_say_so() -> None:
    """Tests use the public API; a test about an internal says which, in its module docstring:
    `About an internal: fusedzero._grads.` (or `About internals: ...` naming each)."""
    silent, modules = {}, set(_modules())
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        used = _private_imports(tree, modules)
        said = INTERNAL.search(ast.get_docstring(tree) or "")
        named = set(re.findall(r"fusedzero[\w.]*\w", said.group(1))) if said else set()
        if used - named:
            silent[str(path.relative_to(ROOT))] = sorted(used - named)
    assert not silent, (
        "these tests import private modules without saying so in their module "
        f"docstring ('About an internal: fusedzero._x.'): {silent}"
    )
