"""The table of memory modes in docs/memory_modes.md: optimizer-state bytes per param and bytes
the update moves per param, for every (master, states), from the same formulas the library uses
(`fusedzero.state.optimizer_bytes`, `fusedzero.kernels.bytes_per_param`).

    python bench/modes_table.py            # prints the markdown table
tests/zero/test_memory_modes_plumbing.py checks that docs/memory_modes.md holds exactly this output.
"""

from __future__ import annotations

import itertools

import torch

from fusedzero.kernels import bytes_per_param
from fusedzero.memory_modes import MASTER_MODES, QBLOCK, STATE_MODES, MemoryModes
from fusedzero.rules._adamw import ADAMW
from fusedzero.state import optimizer_bytes


def table() -> str:
    rows = [
        "| master | states | optimizer state, bytes/param | update moves, bytes/param |",
        "| --- | --- | --- | --- |",
    ]
    for master, states in itertools.product(MASTER_MODES, STATE_MODES):
        state = optimizer_bytes(MemoryModes(master, states), ADAMW, QBLOCK, torch.bfloat16) / QBLOCK
        # bf16 grads; fp32 master writes the bf16 param copy, the bf16 modes the param itself.
        out = torch.bfloat16 if master == "fp32" else None
        moved = bytes_per_param(master, states, torch.bfloat16, out)
        rows.append(f"| {master} | {states} | {state:g} | {moved:g} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
