"""A server for the `fusedzero` command in the docs' shell blocks: one process imports torch and
the CLI once, and each `fusedzero ...` of a block is a fork of it (milliseconds) instead of a fresh
interpreter that imports torch (seconds; ~40 commands in the docs).

`CliServer(folder)` starts the server (`python tests/app/_cli_server.py SOCKET`) and writes a
`fusedzero` client script into `folder`; put `folder` first on PATH. The client sends its
arguments, working directory, environment and its stdin/stdout/stderr (as file descriptors) over
a Unix socket; the server forks, and the fork runs `fusedzero.app.cli.main` with them, then sends
the exit status back. So a block sees the command's real output, exit status and files.

What differs from the installed console script (fusedzero/app/entry.py), on purpose: the command
runs in a fork of an interpreter that imported it already, and `fusedzero train`'s CPU ranks are
forks of the command instead of children of a fork server that imports the training loop again.
The console script itself, its fork server and a killed launcher are tested by tests/app/
(test_entry, test_train, test_lifecycle), which start it as users do.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

# The client: plain standard library (python -S skips site-packages), so it starts in ~20 ms.
CLIENT = r"""#!{python} -S
import json, os, signal, socket, struct, sys
s = socket.socket(socket.AF_UNIX)
s.connect({sock!r})
msg = json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}).encode()
socket.send_fds(s, [struct.pack("!I", len(msg)) + msg], [0, 1, 2])
f = s.makefile("r")
pid = int(f.readline())
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda n, _: os.kill(pid, n))
line = f.readline()
sys.exit(int(line) if line else 1)  # no status: the command was killed
"""


class CliServer:
    """The server process and the folder holding its `fusedzero` client."""

    def __init__(
        self, folder: Path, env: dict[str, str] | None = None, timeout_s: float = 120.0
    ) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        sock = folder / "cli.sock"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(sock)], stdin=subprocess.DEVNULL, env=env
        )
        deadline = time.monotonic() + timeout_s
        while not sock.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the CLI server did not start: exit {self.proc.returncode}")
            time.sleep(0.05)
        client = folder / "fusedzero"
        client.write_text(CLIENT.format(python=sys.executable, sock=str(sock)))
        client.chmod(0o755)
        self.folder = folder

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _serve(path: str) -> None:
    import multiprocessing as mp

    import torch._dynamo  # noqa: F401  (what every rank of `fusedzero train` imports)

    import fusedzero._spawn
    import fusedzero.app.cli
    import fusedzero.app.loop  # noqa: F401

    # Ranks are forks of the command, which has everything imported (see the module docstring).
    fusedzero._spawn.forkserver = lambda preload: mp.get_context("fork")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path + ".tmp")
    srv.listen(16)
    os.rename(path + ".tmp", path)  # the path exists once the server accepts
    while True:
        conn, _ = srv.accept()
        data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        (n,) = struct.unpack("!I", data[:4])
        while len(data) < 4 + n:
            data += conn.recv(1 << 16)
        if os.fork() == 0:
            srv.close()
            _run(conn, fds, json.loads(data[4 : 4 + n]), fusedzero.app.cli.main)
        conn.close()
        for fd in fds:
            os.close(fd)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass


def _run(conn: socket.socket, fds: list[int], req: dict, main: Callable[[list[str]], int]) -> None:
    """In the fork: the client's stdio, folder and environment, then the command."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    sys.argv = ["fusedzero", *req["argv"]]
    conn.sendall(f"{os.getpid()}\n".encode())
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = 1
    try:
        code = main(req["argv"]) or 0
    except SystemExit as e:  # argparse, as the console script would exit
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (BrokenPipeError, OSError):
            pass
    try:
        conn.sendall(f"{code}\n".encode())
    finally:
        os._exit(code)


if __name__ == "__main__":
    _serve(sys.argv[1])
