"""CI: every commit subject on this branch's history reads in `git log --oneline`: at most 72
characters (the rule .githooks/commit-msg applies when a commit is made; docs/contributing.md).

    python .ci/check_subjects.py        # exit 1, naming each offending commit, if any

The hook is opt-in per clone, so CI checks what it would have refused. The rule came after
the history began: 310 of the 546 commits before this check have longer subjects. They are let
through by ancestry, not by date: BASELINE holds the newest commits that broke the rule, and a
commit is checked unless it is one of them or their ancestor (`git log HEAD ^BASE...`), which
also covers branches merged later whose commits predate the rule. A shallow clone cannot tell
which of its commits descend from the baseline, so it checks nothing and says so.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable
from typing import NamedTuple

MAX_SUBJECT = 72  # .githooks/commit-msg's limit: a subject fits `git log --oneline` in 80 columns

# The newest commits whose subjects break the rule (2026-11-27); they and their ancestors are
# not checked.
BASELINE = (
    "ff4549844d87e71e205b1a5c4029b78113c849f8",  # tests: stage-3 touch cases run in a fresh ...
    "fe3e44df075010aa76306fa65152bc6e800d1b19",  # checkpoint: internal modules private by ...
)


class Commit(NamedTuple):
    sha: str
    subject: str


def parse_log(text: str) -> list[Commit]:
    """Commits from `git log --format=%H%x00%s` output (one a line: sha, NUL, subject)."""
    out = []
    for line in text.splitlines():
        if line:
            sha, _, subject = line.partition("\x00")
            out.append(Commit(sha, subject))
    return out


def too_long(commits: Iterable[Commit], limit: int = MAX_SUBJECT) -> list[str]:
    """One line per commit whose subject is over `limit` characters (not bytes: an em dash is
    one), naming its short sha, its length and the subject."""
    return [
        f"{c.sha[:10]}: subject is {len(c.subject)} characters (at most {limit}): {c.subject}"
        for c in commits
        if len(c.subject) > limit
    ]


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], capture_output=True, text=True, encoding="utf-8")


def branch_commits() -> list[Commit]:
    """HEAD's history less the baseline commits and their ancestors (those this clone holds)."""
    present = [
        f"^{sha}" for sha in BASELINE if _git("cat-file", "-e", f"{sha}^{{commit}}").returncode == 0
    ]
    log = _git("log", "--format=%H%x00%s", "HEAD", *present)
    if log.returncode != 0:
        raise SystemExit(f"check_subjects: git log failed: {log.stderr.strip()}")
    return parse_log(log.stdout)


def main() -> int:
    shallow = _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true"
    if shallow:
        print("check_subjects: a shallow clone: subjects not checked (clone the full history)")
        return 0
    commits = branch_commits()
    errors = too_long(commits)
    for e in errors:
        print(e, file=sys.stderr)
    if errors:
        print(
            f"check_subjects: {len(errors)} of {len(commits)} commit subject(s) over "
            f"{MAX_SUBJECT} characters; reword them (git rebase -i, `reword`) and keep the why "
            "in the body (enable the hook: git config core.hooksPath .githooks)",
            file=sys.stderr,
        )
        return 1
    print(
        f"check_subjects: {len(commits)} commit subject(s), each at most {MAX_SUBJECT} characters"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
