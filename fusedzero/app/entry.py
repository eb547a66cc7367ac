"""The `fusedzero` command's entry point (also `python -m fusedzero.cli`).

`fusedzero train` on CPU starts its ranks from a fork server that imports the training loop once
(fusedzero/_spawn.py, fusedzero/app/launch.py). Started here, before the command imports torch,
the server's imports run beside the launcher's own on another core instead of after them: a
few seconds off every CPU run. Skipped where no local CPU ranks will be started (help, torchrun,
`--device cuda`); under `--device auto` on a GPU machine the server idles and leaves with the
launcher.
"""

from __future__ import annotations

import sys

from fusedzero.app.preload import RANK_PRELOAD, under_torchrun


def _starts_cpu_ranks(argv: list[str]) -> bool:
    if argv[:1] != ["train"] or {"-h", "--help"} & set(argv):
        return False
    if under_torchrun():
        return False
    pairs = zip(argv, argv[1:])
    return not ("--device=cuda" in argv or ("--device", "cuda") in pairs)


def start_rank_server(argv: list[str]) -> None:
    """Start the fork server `fusedzero train`'s CPU ranks will come from, now."""
    if not _starts_cpu_ranks(argv):
        return
    import multiprocessing as mp
    from multiprocessing import forkserver

    mp.get_context("forkserver").set_forkserver_preload(RANK_PRELOAD)
    forkserver.ensure_running()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    start_rank_server(argv)
    from fusedzero.app.cli import main as cli_main

    return cli_main(argv)
