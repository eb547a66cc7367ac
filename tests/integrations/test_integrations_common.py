"""fusedzero.integrations' shared part (fast, one process, no framework imported): the core
never imports the frameworks at module level, the keyword checks, the import error naming the
extra, and the full state dict at stages 0 and 3 (a world of one).

About an internal: fusedzero.integrations._common."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from fusedzero.integrations import _common
from fusedzero.optim import ZeroAdamW

PACKAGE = Path(__file__).resolve().parents[2] / "fusedzero"
FRAMEWORKS = ("transformers", "accelerate", "lightning", "pytorch_lightning")
# The two modules that subclass a framework's class, and so import it when imported themselves.
IMPORTS_FRAMEWORK = {"integrations/hf.py", "integrations/lightning.py"}


def module_level_imports(path: Path) -> set[str]:
    """Top-level package names a module imports outside any function (what `import` runs)."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Import):
                names.update(a.name.split(".")[0] for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                names.add(child.module.split(".")[0])
            visit(child)

    visit(ast.parse(path.read_text()))
    return names


def test_the_core_imports_no_framework() -> None:
    """`import fusedzero.<anything>` but the two integration modules leaves transformers,
    accelerate and lightning unimported: they are extras."""
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel not in IMPORTS_FRAMEWORK:
            bad = module_level_imports(path) & set(FRAMEWORKS)
            if bad:
                offenders[rel] = sorted(bad)
    assert not offenders, f"import these lazily (inside functions): {offenders}"
    # The scan sees module-level imports and skips those inside functions.
    assert "torch" in module_level_imports(PACKAGE / "optim.py")
    hf = PACKAGE / "checkpoint" / "hf.py"
    assert "import transformers" in hf.read_text()
    assert "transformers" not in module_level_imports(hf)


def test_missing_framework_names_the_extra() -> None:
    with pytest.raises(ImportError, match=r"pip install 'fusedzero\[lightning\]'"):
        _common.import_framework("no_such_framework_xyz", "lightning", "fusedzero.integrations.x")


def test_zero_kwargs_checks() -> None:
    assert {"stage", "module", "max_grad_norm", "lr"} <= _common.zero_keywords()
    taken = {"lr": "TrainingArguments(learning_rate=...)"}
    _common.check_zero_kwargs({"stage": 2}, taken, "X")  # passes through
    with pytest.raises(TypeError, match=r"X got lr=: it comes from TrainingArguments"):
        _common.check_zero_kwargs({"lr": 1.0}, taken, "X")
    with pytest.raises(TypeError, match=r"X got an unexpected keyword sstage="):
        _common.check_zero_kwargs({"sstage": 2}, taken, "X")


@pytest.mark.parametrize(
    "keyword, where",
    [
        ("param_dtype", r"precision=Precision\(param_dtype=...\)"),
        ("master", r"precision=Precision\(master=...\)"),
        ("unit_policy", r"sharding=Sharding\(units=...\)"),
        ("process_group", r"groups=Groups\(shard=...\)"),
    ],
)
def test_a_moved_keyword_names_its_record(keyword: str, where: str) -> None:
    """A keyword of ZeroAdamW's old flat signature, passed to an integration, names where it
    moved (as ZeroAdamW itself does), not "unexpected keyword"."""
    with pytest.raises(TypeError, match=rf"^X got {keyword}=: it moved, use {where}$"):
        _common.check_zero_kwargs({keyword: None}, {}, "X")


@pytest.mark.parametrize("stage", [0, 3])
def test_full_state_dict(stage: int) -> None:
    """Full values at every stage (at stage 3 the params outside a forward are empty)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ModuleList([torch.nn.Linear(8, 2)]))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    assert _common.full_state_dict(None, model).keys() == want.keys()
    opt = ZeroAdamW(model.parameters(), lr=1e-2, stage=stage, module=model)
    try:
        got = _common.full_state_dict(opt, model)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    finally:
        opt.close()
