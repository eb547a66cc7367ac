"""The `fusedzero` command: one subcommand per module.

    fusedzero train --stage 2 --steps 300
    fusedzero ckpt inspect|verify|export|import-dcp ...
    fusedzero plan --params 7.5e9 --world-size 64
    fusedzero doctor [--json]

Errors in flags, paths or checkpoints print one line, `fusedzero: error: ...`, and exit with 2.
A run that stalls past --timeout prints one such line naming each rank's wait and exits with 1;
Ctrl-C exits with 130, SIGTERM/SIGHUP with 128 + the signal number, the ranks ended either way;
a closed stdout (`fusedzero train | head`) ends the run quietly with 141 (128 + SIGPIPE).
Anything else that goes wrong (a rank killed, a disk error) is one line too, exit 1: tracebacks
only with `--debug` (anywhere on the command line) or FUSEDZERO_DEBUG=1.
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
SUBCOMMANDS = (add_train_subparser, add_ckpt_subparser, add_plan_subparser, add_doctor_subparser)


def build_parser() -> ArgParser:
    parser = ArgParser(prog="fusedzero", description="Sharded data-parallel AdamW (ZeRO-0..3)")
    # Taken out of argv by `main` wherever it stands; here for --help.
    parser.add_argument(
        "--debug", action="store_true", help="show Python tracebacks (also FUSEDZERO_DEBUG=1)"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_subparser in SUBCOMMANDS:
        add_subparser(subparsers)
    return parser


def _one_line(e: BaseException) -> str:
    """An unexpected error as one line: its message's last line when it holds a traceback."""
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    if any(ln.startswith("Traceback (most recent call last)") for ln in lines):
        lines = lines[-1:]
    msg = " ".join(" ".join(lines).split()) or type(e).__name__
    return msg if len(msg) <= 1000 else msg[:997] + "..."


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("FUSEDZERO_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
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
    except Exception as e:  # noqa: BLE001 - the last line of defence: no traceback by default
        if debug:
            detail = getattr(e, "detail", "")
            if detail:
                print(detail, file=sys.stderr)
            raise
        kind = (
            "" if type(e).__name__ in ("RankFailed", "CheckpointError") else f"{type(e).__name__}: "
        )
        print(
            f"fusedzero: error: {kind}{_one_line(e)} (--debug shows the traceback)", file=sys.stderr
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
