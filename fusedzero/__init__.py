"""fusedzero: sharded data-parallel AdamW (ZeRO-0/1/2/3) with one fused Triton update kernel."""
import warnings

# numpy is not a dependency, but `import torch` warns "Failed to initialize NumPy" when it is
# missing (torch.export -> functional_tensor converts a tensor at import), once per process: the
# launcher and every spawned rank of `fusedzero train`. Nothing here needs numpy, so the warning
# is filtered by its exact message before torch is first imported through this package.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

from fusedzero.optim import MemoryReport, Stage, ZeroAdamW  # noqa: E402

__version__ = "0.1.0"
__all__ = ["MemoryReport", "Stage", "ZeroAdamW", "__version__"]
