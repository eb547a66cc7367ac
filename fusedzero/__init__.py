"""fusedzero: sharded data-parallel AdamW (ZeRO-0/1/2/3) with one fused Triton update kernel.

The public names are imported on first use (PEP 562), so `import fusedzero.app` (the CLI) can set
its own warning policy before torch is first imported; a library never changes its host's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["MemoryReport", "Stage", "ZeroAdamW", "__version__"]

if TYPE_CHECKING:
    from fusedzero.optim import MemoryReport, Stage, ZeroAdamW


def __getattr__(name: str) -> Any:
    if name in ("MemoryReport", "Stage", "ZeroAdamW"):
        from fusedzero import optim
        return getattr(optim, name)
    raise AttributeError(f"module 'fusedzero' has no attribute {name!r}")
