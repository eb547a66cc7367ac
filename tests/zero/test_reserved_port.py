"""See [Note: a port held for the ranks] (fusedzero/_spawn.py): while a port is reserved no other
bind takes it, and rank 0's store still listens on it. Before: `SpawnedRanks` (every
`fusedzero train` and test pool) chose a port free at that moment and released it, and a CI
run's `fusedzero train` failed with EADDRINUSE when another test's process bound it first.

About an internal: fusedzero._spawn."""

from __future__ import annotations

import datetime
import errno
import socket

import pytest
import torch.distributed as dist

from fusedzero._spawn import reserve_port


def test_a_reserved_port_refuses_other_binds_and_takes_the_store() -> None:
    held = reserve_port()
    port = held.getsockname()[1]
    try:
        with socket.socket() as other, pytest.raises(OSError) as e:
            other.bind(("127.0.0.1", port))
        assert e.value.errno == errno.EADDRINUSE
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=30),
        )
        dist.destroy_process_group()
    finally:
        held.close()
