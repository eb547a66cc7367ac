"""fusedzero: sharded data-parallel AdamW (ZeRO-0/1/2/3) with one fused Triton update kernel."""
from fusedzero.optim import MemoryReport, Stage, ZeroAdamW

__version__ = "0.1.0"
__all__ = ["MemoryReport", "Stage", "ZeroAdamW", "__version__"]
