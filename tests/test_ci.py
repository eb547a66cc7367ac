""".ci/run: it checks commit subjects before the tests (.ci/check_subjects.py, on synthetic
logs here: no git is run), and its test command is, character for character, the one README.md
gives."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "check_subjects", ROOT / ".ci" / "check_subjects.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_subjects_over_72_characters_are_named_and_72_pass() -> None:
    cs = _checker()
    log = "".join(
        f"{sha}\x00{subject}\n"
        for sha, subject in [
            ("a" * 40, "x" * 72),
            ("b" * 40, "y" * 73),
            ("c" * 40, "é" * 72),  # 72 characters, 144 bytes: passes
            ("d" * 40, "subject with a\x00NUL is kept whole"),
        ]
    )
    commits = cs.parse_log(log)
    assert [c.sha[0] for c in commits] == ["a", "b", "c", "d"]
    assert commits[3].subject == "subject with a\x00NUL is kept whole"
    errors = cs.too_long(commits)
    assert errors == [f"bbbbbbbbbb: subject is 73 characters (at most 72): {'y' * 73}"], errors
    assert cs.too_long([], 72) == [] and cs.parse_log("") == []


def test_the_limit_is_the_commit_hooks() -> None:
    hook = (ROOT / ".githooks" / "commit-msg").read_text()
    limit = re.search(r"\$\{#subject\} -gt (\d+)", hook)
    assert limit is not None, "the hook's length test moved; update this test"
    assert int(limit.group(1)) == _checker().MAX_SUBJECT


def test_ci_checks_subjects_before_the_tests_and_runs_readmes_test_command() -> None:
    run = (ROOT / ".ci" / "run").read_text().splitlines()
    tests = [i for i, line in enumerate(run) if line.startswith("python -m pytest")]
    subjects = [i for i, line in enumerate(run) if line.strip() == "python3 .ci/check_subjects.py"]
    assert len(tests) == 1 and len(subjects) == 1 and subjects[0] < tests[0], run
    readme = (ROOT / "README.md").read_text()
    fence = re.search(r"```sh install-only\n(.*'\.\[dev\]'.*)\n```", readme)
    assert fence is not None, "README.md's install-and-test block moved"
    assert fence.group(1).endswith(" && " + run[tests[0]]), (fence.group(1), run[tests[0]])
