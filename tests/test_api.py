"""The public API (docs/api.md): every public module lists its names in `__all__`, every name
there exists, and docs/api.md names each one, so the page and the code cannot drift apart."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = ("fusedzero", "fusedzero.policy", "fusedzero.optim", "fusedzero.checkpoint",
          "fusedzero.checkpoint.dcp", "fusedzero.checkpoint.hf", "fusedzero.kernels",
          "fusedzero.plan", "fusedzero.emulate", "fusedzero.emulate_ckpt", "fusedzero.testing",
          "fusedzero.stage", "fusedzero.state", "fusedzero.memory_modes", "fusedzero.wire")
# Listed in __all__ for import-star and tools; the page describes these modules as a whole.
NOT_NAMED = {"fusedzero": {"__version__"}, "fusedzero.memory_modes": None,
             "fusedzero.wire": None}


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
