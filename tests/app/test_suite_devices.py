"""Every test that starts `fusedzero train` states its device: on a GPU machine the
default, `--device auto`, takes one rank per GPU and refuses `--nproc 2` on one GPU.

A scan of tests/ sources (ast; no test module is imported or run) finds each argv of
`fusedzero train`: a list whose first element is "train" (or that runs `-m fusedzero.cli train`),
and the first argument of `fusedzero.app.launch.run`. Each must pass `--device`, literally or
through what it spreads or adds (`*TINY`, `*_base(...)`, `base[1:] + [...]`, names resolved to
their assignments in the function, then the module). An argv of string constants alone goes
through the CLI instead, with one GPU faked visible (the `one_gpu` fixture): it passes if the
parser refuses it (a usage-error test: no rank starts) or the device choice keeps it on the CPU.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from fusedzero.app.config import UsageError, parse_args
from fusedzero.app.launch import local_ranks

TESTS = Path(__file__).resolve().parents[1]
# Modules whose train argvs leave the device to `auto` on purpose.
EXEMPT = {
    "app/test_device_choice.py": "tests the device choice itself, one GPU faked visible",
    "app/test_entry.py": "tests which argvs start the fork server; nothing is launched",
    "app/test_suite_devices.py": "this scan: its lists are patterns and made-up sources",
}
_LAUNCH_RUN = ("fusedzero.app.launch", "run")


def _module_files() -> list[str]:
    return sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py"))


def _shallow(node: ast.AST) -> Iterator[ast.AST]:
    """ast.walk that does not enter nested functions (each is a scope of its own)."""
    todo = list(ast.iter_child_nodes(node))
    while todo:
        sub = todo.pop()
        yield sub
        if not isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo.extend(ast.iter_child_nodes(sub))


class _Scope:
    """What a name in one function (or the module) can resolve to: its assignments there, or a
    function defined there; else the enclosing scope's."""

    def __init__(self, node: ast.AST, parent: _Scope | None) -> None:
        self.parent = parent
        self.assigned: dict[str, list[ast.expr]] = {}
        self.functions: dict[str, ast.FunctionDef] = {}
        for sub in _shallow(node):
            if isinstance(sub, ast.Assign):
                for t in sub.targets:
                    if isinstance(t, ast.Name):
                        self.assigned.setdefault(t.id, []).append(sub.value)
            elif (
                isinstance(sub, ast.AnnAssign)
                and isinstance(sub.target, ast.Name)
                and sub.value is not None
            ):
                self.assigned.setdefault(sub.target.id, []).append(sub.value)
            elif isinstance(sub, ast.FunctionDef):
                self.functions[sub.name] = sub

    def lookup(self, name: str) -> list[ast.expr] | ast.FunctionDef | None:
        scope: _Scope | None = self
        while scope is not None:
            if name in scope.assigned:
                return scope.assigned[name]
            if name in scope.functions:
                return scope.functions[name]
            scope = scope.parent
        return None


def _states_device(node: ast.expr, scope: _Scope, depth: int = 0) -> bool:
    """Does this argv expression pass --device, as far as the source shows?"""
    if depth > 8:  # a name that resolves to itself, or deeper than any test goes
        return False

    def again(sub: ast.expr) -> bool:
        return _states_device(sub, scope, depth + 1)

    if isinstance(node, (ast.List, ast.Tuple)):
        return any(
            (
                isinstance(e, ast.Constant)
                and isinstance(e.value, str)
                and (e.value == "--device" or e.value.startswith("--device="))
            )
            or (isinstance(e, ast.Starred) and again(e.value))
            for e in node.elts
        )
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return again(node.left) or again(node.right)
    if isinstance(node, (ast.Starred, ast.Subscript)):  # *TINY, TINY[:-3]
        return again(node.value)
    found: list[ast.expr] | ast.FunctionDef | None = None
    if isinstance(node, ast.Name):
        found = scope.lookup(node.id)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        found = scope.lookup(node.func.id)
        found = found if isinstance(found, ast.FunctionDef) else None
    if isinstance(found, ast.FunctionDef):  # a helper: every list it returns
        inner = _Scope(found, scope)
        returns = [r.value for r in _shallow(found) if isinstance(r, ast.Return) and r.value]
        return bool(returns) and all(_states_device(r, inner, depth + 1) for r in returns)
    return bool(found) and all(again(v) for v in found)


def _constants(node: ast.expr) -> list[str] | None:
    if isinstance(node, ast.List) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
    ):
        return [e.value for e in node.elts]
    return None


def _is_train_argv(node: ast.List) -> bool:
    words = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
    return words[:1] == ["train"] or any(
        a == "fusedzero.cli" and b == "train" for a, b in zip(words, words[1:])
    )


def train_argvs(source: str) -> list[tuple[int, ast.expr, _Scope]]:
    """(line, argv expression, its scope) of every `fusedzero train` argv in a test module."""
    tree = ast.parse(source)
    run_names = {
        a.asname or a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom)
        for a in n.names
        if (n.module, a.name) == _LAUNCH_RUN
    }
    found: list[tuple[int, ast.expr, _Scope]] = []

    def visit(node: ast.AST, scope: _Scope) -> None:
        for sub in _shallow(node):
            if isinstance(sub, ast.List) and _is_train_argv(sub):
                found.append((sub.lineno, sub, scope))
            elif (
                isinstance(sub, ast.Call)
                and isinstance(sub.func, ast.Name)
                and sub.func.id in run_names
                and sub.args
            ):
                found.append((sub.lineno, sub.args[0], scope))
            elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(sub, _Scope(sub, scope))

    visit(tree, _Scope(tree, None))
    return sorted(found, key=lambda f: f[0])


def devices_unstated(source: str) -> list[str]:
    """'line N: why' for each train argv of `source` that may leave the device to `auto`. Call
    under one faked GPU (constant argvs go through the CLI's device choice)."""
    bad = []
    for line, node, scope in train_argvs(source):
        words = _constants(node)
        if words is not None and words[:1] == ["train"]:
            try:
                cfg = parse_args(words[1:])
            except (UsageError, SystemExit):
                continue  # refused by the parser: no rank starts, whatever the device
            try:
                use_cuda, _ = local_ranks(cfg)
            except UsageError as e:
                bad.append(f"line {line}: with one GPU visible, {words} fails: {e}")
                continue
            if use_cuda:
                bad.append(f"line {line}: with one GPU visible, {words} runs on the GPU")
        elif not _states_device(node, scope):
            bad.append(f"line {line}: {ast.unparse(node)[:120]} passes no --device")
    return bad


def _unstated(module: str) -> list[str]:
    text = (TESTS / module).read_text()
    # Most modules never name the subcommand or the launcher: no need to parse them.
    if '"train"' not in text and "fusedzero.app.launch import" not in text:
        return []
    return [f"tests/{module}: {b}" for b in devices_unstated(text)]


def test_train_argvs_state_their_device(one_gpu: None) -> None:
    bad = [b for m in _module_files() if m not in EXEMPT for b in _unstated(m)]
    assert not bad, (
        "`fusedzero train` argvs that leave the device to auto (on a GPU machine "
        "it takes the GPUs; pass --device cpu):\n" + "\n".join(bad)
    )


def test_exempt_and_pending_name_modules_that_exist() -> None:
    missing = sorted(set(EXEMPT) - set(_module_files()))
    assert not missing, f"EXEMPT entries that name no test module: {missing}"


def test_the_scan_finds_what_it_should(one_gpu: None) -> None:
    """The scan itself, on a made-up module: each shape of argv, with and without a device."""
    source = """
from fusedzero.app.launch import run as train_run
TINY = ["--n-layer", "1", "--device", "cpu"]
BARE = ["--n-layer", "1"]

def _base(p):
    return ["--data", str(p), *TINY]

def test_a(cli_main, data):
    argv = ["train", *_base(data), "--nproc", "2"]            # ok: through _base, then TINY
    cli_main(argv)
    train_run(argv[1:] + ["--resume"])                         # ok: argv resolved
    train_run(BARE + ["--nproc", "2"])                         # 13: no device
    cli_main(["train", "--nproc", "2"])                        # 14: the GPU refuses 2 ranks
    cli_main(["train", "--stage", "9"])                        # ok: the parser refuses it
    cli_main(["train", "--device", "cpu", "--nproc", "2"])     # ok: constant, on the CPU
    subprocess.run([sys.executable, "-m", "fusedzero.cli", "train", *BARE])  # 17: no device
    subprocess.run(["x", "-m", "fusedzero.cli", "train", "--device=cpu", *BARE])  # ok
"""
    bad = devices_unstated(source)
    assert [b.split(":")[0] for b in bad] == ["line 13", "line 14", "line 17"], bad
    assert "exceeds the 1 visible GPUs" in bad[1], bad
