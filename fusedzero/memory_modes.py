"""Memory modes of the optimizer state: what a (master, states) pair allocates and how a state
saved in one mode is read into another.

    MemoryModes(master="bf16-kahan", states="int8")

The numerics (the kernel variants, the int8 maps, stochastic rounding) are
`fusedzero.kernels._memory_modes`; this module is the library's side: the record a flat buffer
keeps, its resident bytes per element (the formula `opt.memory()` and `fusedzero plan` share), and
the conversions checkpoints use when they load a state saved in another mode.

[Note: converting masters] A master is held as one of: an fp32 master (with the bf16 param its
rounded copy), the bf16 param alone ("bf16", "bf16-sr"), or the bf16 param plus a bf16 Kahan
compensation ("bf16-kahan": the effective master is param + comp, in fp32). Into another mode:
- fp32 -> bf16-kahan: param = rne(x), comp = rne(x - param), the closest two bf16s hold to x
  (x - param is exact in fp32; only the comp's own rounding is lost, ~2**-16 relative of x).
- bf16-kahan -> fp32: x = param + comp in fp32.
- fp32 -> bf16 / bf16-sr: param = rne(x) (the param the fp32 run's model had); the reverse
  reads the param exactly.
States go through fp32: dequantize (int8, bf16) and quantize into the new mode. A load in the
same mode copies the stored tensors as they are (bit-exact resume).
"""

from __future__ import annotations

import dataclasses

import torch

from fusedzero.kernels._memory_modes import (
    MASTER_MODES,
    QBLOCK,
    STATE_DTYPES,
    STATE_MODES,
    dequantize_blockwise,
    quantize_blockwise,
)

__all__ = [
    "MASTER_MODES",
    "QBLOCK",
    "STATE_MODES",
    "MemoryModes",
    "decode_master",
    "decode_state",
    "encode_master",
    "encode_state",
]


@dataclasses.dataclass(frozen=True)
class MemoryModes:
    """How a flat buffer holds its optimizer state (validated at construction)."""

    master: str = "fp32"
    """"fp32" | "bf16-kahan" | "bf16-sr" | "bf16" (see fusedzero.kernels._memory_modes)."""
    states: str = "fp32"
    """"fp32" | "bf16" | "int8" for the update rule's state (fusedzero/rules)."""

    def __post_init__(self) -> None:
        if self.master not in MASTER_MODES:
            raise ValueError(f"master={self.master!r}, expected one of {MASTER_MODES}")
        if self.states not in STATE_MODES:
            raise ValueError(f"states={self.states!r}, expected one of {STATE_MODES}")

    @property
    def fp32_master(self) -> bool:
        return self.master == "fp32"

    @property
    def kahan(self) -> bool:
        return self.master == "bf16-kahan"

    @property
    def quantized(self) -> bool:
        return self.states == "int8"

    @property
    def state_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """The storage dtypes of a (signed, non-negative) state in this mode: fp32, bf16, or
        int8 and uint8 codes."""
        return STATE_DTYPES[self.states]

    def master_bytes(self, local_numel: int, param_dtype: torch.dtype) -> int:
        """Resident bytes of the master beside the params over a local shard of `local_numel`
        elements whose params are `param_dtype`: the fp32 master unless the params are fp32
        (then they are their own master) or a bf16 mode; the Kahan compensation. The update
        rule's state comes on top (`fusedzero.state.optimizer_bytes`)."""
        per = 0
        if self.fp32_master and param_dtype != torch.float32:
            per += 4
        if self.kahan:
            per += 2
        return per * local_numel

    def to_json(self) -> dict[str, str]:
        return {"master": self.master, "states": self.states}


def check_param_dtype(modes: MemoryModes, dtype: torch.dtype, what: str) -> None:
    """bf16 master modes update the bf16 param itself: the params must be bf16."""
    if not modes.fp32_master and dtype != torch.bfloat16:
        raise ValueError(
            f"Precision(master={modes.master!r}) keeps no fp32 master: the bf16 params are "
            f"the master, but {what} is {dtype}; pass Precision(param_dtype=torch.bfloat16) "
            "(or bf16 params), or Precision(master='fp32')"
        )


# -- conversions between modes (checkpoints) ---------------------------------------------------
def decode_master(master: torch.Tensor, comp: torch.Tensor | None) -> torch.Tensor:
    """The effective fp32 master of a stored (master[, comp]) pair."""
    x = master.float()
    return x + comp.float() if comp is not None else x


def encode_master(x: torch.Tensor, modes: MemoryModes) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 master values `x` as `modes` stores them: (master, comp or None)."""
    if modes.fp32_master:
        return x.float(), None
    p = x.to(torch.bfloat16)  # round to nearest even
    if not modes.kahan:
        return p, None
    return p, (x.float() - p.float()).to(torch.bfloat16)


def decode_state(t: torch.Tensor, scale: torch.Tensor | None, *, signed: bool) -> torch.Tensor:
    """fp32 values of a stored state (int8/uint8 codes with their block scales, bf16 or fp32)."""
    if scale is not None:
        return dequantize_blockwise(t, scale.float(), signed=signed)
    return t.float()


def encode_state(
    x: torch.Tensor, modes: MemoryModes, *, signed: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 state values as `modes` stores them: (tensor, block scales or None)."""
    if modes.quantized:
        return quantize_blockwise(x.float().contiguous(), signed=signed)
    return x.to(modes.state_dtypes[0 if signed else 1]), None
