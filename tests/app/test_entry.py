"""The `fusedzero` entry point: which commands start the rank fork server early, and that it
hands every command to the CLI."""

from __future__ import annotations

import pytest

from fusedzero.app import entry
from fusedzero.app.preload import TORCHRUN_ENV


@pytest.mark.parametrize(
    "argv, env, starts",
    [
        (["train"], {}, True),
        (["train", "--device", "cpu", "--nproc", "4"], {}, True),
        (["train", "--device", "cuda"], {}, False),
        (["train", "--device=cuda"], {}, False),
        (["train", "--help"], {}, False),
        (["train"], {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, False),  # under torchrun
        (["plan", "--params", "1e9"], {}, False),
        ([], {}, False),
    ],
)
def test_fork_server_starts_only_where_cpu_ranks_will(
    argv: list[str], env: dict[str, str], starts: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k in TORCHRUN_ENV:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert entry._starts_cpu_ranks(argv) is starts


def test_main_hands_the_command_to_the_cli(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[list[str]] = []
    monkeypatch.setattr(entry, "start_rank_server", seen.append)  # no server in this process
    assert entry.main(["plan", "--params", "1e9", "-W", "8", "--json"]) == 0
    assert '"world_size": 8' in capsys.readouterr().out
    assert entry.main(["train", "--steps", "0"]) == 2  # a usage error: one line
    assert "fusedzero: error:" in capsys.readouterr().err
    assert seen == [["plan", "--params", "1e9", "-W", "8", "--json"], ["train", "--steps", "0"]]
