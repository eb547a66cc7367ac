"""The `fusedzero` command: one subcommand per module.

    fusedzero train --stage 2 --steps 300
    fusedzero ckpt inspect|verify|export|import-dcp ...
    fusedzero plan --params 7.5e9 --world-size 64
    fusedzero doctor [--json]

Errors in flags, paths or checkpoints print one line, `fusedzero: error: ...`, and exit with 2.
A run that stalls past --timeout prints one such line naming each rank's wait and exits with 1;
Ctrl-C exits with 130, SIGTERM/SIGHUP with 128 + the signal number, the ranks ended either way;
a closed stdout (`fusedzero train | head`) ends the run quietly with 141 (128 + SIGPIPE).
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys

from fusedzero.app.ckpt_cli import add_ckpt_subparser
from fusedzero.app.config import ArgParser, StalledError, UsageError
from fusedzero.app.doctor import add_doctor_subparser
from fusedzero.app.launch import add_train_subparser
from fusedzero.app.lifecycle import Terminated
from fusedzero.app.plan_cli import add_plan_subparser

# Each adds its subparser to the `subparsers` action and calls `set_defaults(func=...)` with a
# function of the parsed args that returns the exit code.
SUBCOMMANDS = (add_train_subparser, add_ckpt_subparser, add_plan_subparser,
               add_doctor_subparser)


def build_parser() -> ArgParser:
    parser = ArgParser(prog="fusedzero", description="Sharded data-parallel AdamW (ZeRO-0..3)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_subparser in SUBCOMMANDS:
        add_subparser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except UsageError as e:
        msg = " ".join(str(e).split())  # one line, always
        msg = msg.removeprefix("fusedzero: ")
        print(f"fusedzero: error: {msg}", file=sys.stderr)
        return 2
    except StalledError as e:
        print(f"fusedzero: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except Terminated as e:
        print(f"fusedzero: terminated by {e}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("fusedzero: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout's reader left (`fusedzero train | head`): end quietly with the status of a
        # process that SIGPIPE ended, as `yes | head` does; stdout goes nowhere from here on,
        # so the interpreter's flush at exit cannot raise again.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
