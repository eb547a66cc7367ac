"""fusedzero: sharded data-parallel AdamW (ZeRO-0/1/2/3) with one fused Triton update kernel.

The public names are imported on first use (PEP 562), so `import fusedzero.app` (the CLI) can set
its own warning policy before torch is first imported; a library never changes its host's.
docs/api.md lists the public API.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "FullUnitInit",
    "Groups",
    "MemoryReport",
    "Precision",
    "Sharding",
    "ShardInit",
    "Stage",
    "Wire",
    "ZeroAdamW",
    "ZeroMuon",
    "__version__",
    "muon_param_groups",
]

if TYPE_CHECKING:
    from fusedzero._muon_groups import muon_param_groups
    from fusedzero._units import FullUnitInit, ShardInit
    from fusedzero.optim import MemoryReport, Stage, ZeroAdamW, ZeroMuon
    from fusedzero.policy import Groups, Precision, Sharding, Wire

# Public name -> the module that defines it, imported on first use.
_HOMES = {
    "MemoryReport": "optim",
    "Stage": "optim",
    "ZeroAdamW": "optim",
    "ZeroMuon": "optim",
    "muon_param_groups": "_muon_groups",
    "Groups": "policy",
    "Precision": "policy",
    "Sharding": "policy",
    "Wire": "policy",
    "ShardInit": "_units",
    "FullUnitInit": "_units",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f"fusedzero.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'fusedzero' has no attribute {name!r}")
