"""The `fusedzero` command: subcommands registered from a list, each module optional.

    fusedzero train --stage 2 --steps 300
    fusedzero ckpt ...            # when fusedzero.ckpt_cli is part of the build
    fusedzero plan --params 7.5e9 --world-size 64

Errors in flags, paths or checkpoints print one line, `fusedzero: error: ...`, and exit with 2.
A run that stalls past --timeout prints one such line naming each rank's wait and exits with 1;
Ctrl-C exits with 130, SIGTERM/SIGHUP with 128 + the signal number, the ranks ended either way.
"""
from __future__ import annotations

import importlib
import sys

from fusedzero.lifecycle import Terminated
from fusedzero.train import ArgParser, StalledError, UsageError

# (module, function adding its subparser): a subcommand whose module is not in this build is
# left out. Each function takes the `subparsers` action and calls `set_defaults(func=...)`
# with a function of the parsed args that returns the exit code.
SUBCOMMANDS: list[tuple[str, str]] = [
    ("fusedzero.train", "add_train_subparser"),
    ("fusedzero.ckpt_cli", "add_ckpt_subparser"),
    ("fusedzero.bench_cli", "add_bench_subparser"),
    ("fusedzero.plan", "add_plan_subparser"),
]


def build_parser() -> ArgParser:
    parser = ArgParser(prog="fusedzero", description="Sharded data-parallel AdamW (ZeRO-0..3)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module, fn in SUBCOMMANDS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == module:
                continue  # not part of this build
            raise
        getattr(mod, fn)(subparsers)
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


if __name__ == "__main__":
    sys.exit(main())
