"""Reading and writing a rank's optimizer state through the records of fusedzero/state.py.

`ShardAccess` is what `ZeroOptimizer.shard_infos / param_infos / shard_state / load_shard_state`
delegate to: it sees the flat buffers, the step scalars and the param all-gather, nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fusedzero._flat import FlatBuffer
from fusedzero._local_param import write_runs
from fusedzero._param_sync import ParamSync
from fusedzero._scalars import StepScalars
from fusedzero.memory_modes import MemoryModes
from fusedzero.rules import Rule
from fusedzero.state import ParamInfo, ShardInfo, ShardState, convert, fields_of


class ShardAccess:
    """`before_write` runs before master (and the param shard derived from it) is rewritten:
    nothing in flight may read the shards then, and no gathered copy of them may outlive the
    write (ZeroOptimizer.quiesce_params). `rules[gi]` is param group gi's update rule: a
    buffer holds its group's rule's state fields."""

    def __init__(
        self,
        rules: list[Rule],
        buffers: list[FlatBuffer],
        scalars: StepScalars,
        param_sync: ParamSync,
        before_write: Callable[[], None],
    ) -> None:
        self.rules = rules
        self.buffers = buffers
        self.scalars = scalars
        self.param_sync = param_sync
        self.before_write = before_write

    def _fields(self, buf: FlatBuffer, modes: MemoryModes) -> tuple[str, ...]:
        return fields_of(modes, self.rules[buf.group_index])

    def _names(self, modes: MemoryModes) -> tuple[str, ...]:
        """Every field some buffer holds in `modes`, master first, then each rule's in order."""
        return tuple(dict.fromkeys(f for r in self.rules for f in fields_of(modes, r)))

    def _rule_names(self) -> str:
        names = list(dict.fromkeys(r.name for r in self.rules))
        return (
            f"the {names[0]} rule keeps"
            if len(names) == 1
            else (f"the {' and '.join(names)} rules keep")
        )

    def shard_infos(self) -> list[ShardInfo]:
        return [
            ShardInfo(
                group_index=b.group_index,
                dtype=b.dtype,
                unit=b.unit,
                layout=b.layout,
                shard_rank=b.shard_rank,
                modes=b.modes,
            )
            for b in self.buffers
        ]

    def param_infos(self, param_groups: list[dict[str, Any]]) -> list[ParamInfo]:
        # Shapes from the layout: a stage-3 param is an empty tensor while its unit is freed.
        slots = {s.index: (s, b) for b in self.buffers for s in b.layout.params}
        out = []
        for gi, g in enumerate(param_groups):
            for _ in g["params"]:
                s, b = slots[len(out)]
                out.append(
                    ParamInfo(
                        index=s.index, name=s.name, shape=s.shape, dtype=b.dtype, group_index=gi
                    )
                )
        return out

    def write_param_runs(
        self, params: list[nn.Parameter], read: Callable[[int, int, int], torch.Tensor]
    ) -> bool:
        """Stage 3: every run of every param this rank holds written into its shards (master
        and param shard) as `read(i, a, b)` gives elements [a, b) of `params[i]`'s flattened
        full value, one run held at a time; True. Below stage 3 nothing is written: False (the
        caller stages the master and writes it with `load_shard_state`)."""
        if not any(b.stage.shards_params for b in self.buffers):
            return False
        self.before_write()
        write_runs(self.buffers, params, read)
        return True

    def master(self, buf: FlatBuffer) -> torch.Tensor:
        # fp32 params are their own master: let the param all-gather in flight land first.
        self.param_sync.wait()
        return buf.read_master()

    def set_master(self, buf: FlatBuffer, values: torch.Tensor) -> None:
        """Write master and the params derived from it, then gather them (stages 1-2)."""
        self.before_write()  # the write must not race an all-gather in flight
        buf.write_master(values)
        self.param_sync.gather()
        self.param_sync.wait()

    def shard_state(self) -> ShardState:
        """Every buffer's state as it is stored (all buffers share the optimizer's modes); a
        field's entry is None for a buffer whose rule does not keep it."""
        scaler = self.scalars.scaler
        modes = self.buffers[0].modes if self.buffers else ShardState().modes

        def tensor(b: FlatBuffer, f: str) -> torch.Tensor | None:
            if f not in self._fields(b, modes):
                return None
            if f == "master":
                return self.master(b)
            return b.comp if f == "comp" else b.state[f]

        lists = {f: [tensor(b, f) for b in self.buffers] for f in self._names(modes)}
        return ShardState(
            **lists,
            modes=modes,
            step_count=float(self.scalars.step.reshape(-1)[0]),  # a host sync
            scaler=None if scaler is None else scaler.values(),
        )

    def load_shard_state(self, st: ShardState) -> None:
        """Write `st` (converted from its modes into each buffer's, `fusedzero.state.convert`).
        Everything is converted and checked before the first buffer is written."""
        n = len(self.buffers)
        known = self._names(st.modes)
        unknown = [name for name in st.names() if name not in known]
        if unknown:
            raise ValueError(
                f"shard state has fields {unknown}; in its modes {self._rule_names()} {list(known)}"
            )
        for name in st.names():
            values = st.get(name)
            if values is not None and len(values) != n:
                raise ValueError(
                    f"shard state has {len(values)} {name} buffers, the optimizer has {n}"
                )
        with torch.no_grad():
            new = [
                convert(st.tensors(i), st.modes, buf.modes, self.rules[buf.group_index])
                for i, buf in enumerate(self.buffers)
            ]
            for t, buf in zip(new, self.buffers):
                for f in buf.state_fields:
                    if f.scale_of is not None and f.scale_of in t and f.name not in t:
                        raise ValueError(f"shard state gives int8 {f.scale_of} without its scales")
            for t, buf in zip(new, self.buffers):
                for name, dst in buf.state.items():
                    if name in t:
                        dst.copy_(t[name])
            if st.master is not None:
                self.before_write()
                for t, buf in zip(new, self.buffers):
                    buf.write_master(t["master"], t.get("comp"))
                self.param_sync.gather()
                self.param_sync.wait()
            if st.step_count is not None:
                self.scalars.step.fill_(st.step_count)
            scaler = self.scalars.scaler
            if st.scaler is not None and scaler is not None:
                scaler.load_values(st.scaler)

    # -- torch.optim-style state dicts (this rank's shard, same layout only) -------------------
    def flat_state(self) -> dict[str, Any]:
        st = self.shard_state()
        flat = [{k: t.clone() for k, t in st.tensors(i).items()} for i in range(len(self.buffers))]
        state: dict[str, Any] = {
            "step": self.scalars.step.clone(),
            "flat": flat,
            "modes": st.modes.to_json(),
        }
        if self.scalars.scaler is not None:
            state["scaler"] = self.scalars.scaler.state_dict()
        return state

    def load_flat_state(self, state: dict[str, Any]) -> None:
        flat = state["flat"]
        if len(flat) != len(self.buffers):
            raise ValueError(
                f"state dict has {len(flat)} flat buffers, optimizer has {len(self.buffers)}"
            )
        with torch.no_grad():
            self.scalars.step.copy_(state["step"])
            if self.scalars.scaler is not None and "scaler" in state:
                self.scalars.scaler.load_state_dict(state["scaler"])
        modes = MemoryModes(**state.get("modes", {}))
        # Each buffer's entry holds its rule's fields (None: a field its rule does not keep).
        self.load_shard_state(
            ShardState(
                **{
                    f: [
                        d[f] if f in self._fields(b, modes) else None
                        for d, b in zip(flat, self.buffers)
                    ]
                    for f in self._names(modes)
                },
                modes=modes,
            )
        )

    def state_dict(
        self, param_groups: list[dict[str, Any]], layout_key: dict[str, Any]
    ) -> dict[str, Any]:
        groups = []
        index = 0
        for g in param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(d)
        return {"state": self.flat_state(), "param_groups": groups, "layout": layout_key}

    def load_state_dict(
        self,
        state_dict: dict[str, Any],
        param_groups: list[dict[str, Any]],
        layout_key: dict[str, Any],
    ) -> None:
        key = state_dict.get("layout")
        if key != layout_key:
            raise ValueError(
                f"state dict was saved with layout {key}, this optimizer has "
                f"{layout_key}; use fusedzero.checkpoint to load across "
                "world sizes or stages"
            )
        groups = state_dict["param_groups"]
        if len(groups) != len(param_groups):
            raise ValueError(
                f"state dict has {len(groups)} param groups, optimizer has {len(param_groups)}"
            )
        for mine, saved in zip(param_groups, groups):
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError("param group sizes differ between state dict and optimizer")
            for k, v in saved.items():
                if k != "params":
                    mine[k] = v
        self.load_flat_state(state_dict["state"])


class ShardStateMethods:
    """The optimizer's state dict and the typed interface of fusedzero/state.py (checkpoints,
    importers, plan), delegated to its `ShardAccess`."""

    shards: ShardAccess
    param_groups: list[dict[str, Any]]
    world_size: int
    rank: int
    stage: int
    bucket_numel: int | None
    flat_groups: list[FlatBuffer]
    params: list[nn.Parameter]

    # -- state dict (this rank's shard; `fusedzero.checkpoint` reshards) ----------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's shard, loadable into an optimizer of the same layout only
        (`fusedzero.checkpoint` reshards across world sizes and stages)."""
        return self.shards.state_dict(self.param_groups, self.layout_key())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.shards.load_state_dict(state_dict, self.param_groups, self.layout_key())

    def layout_key(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "stage": int(self.stage),
            "bucket_numel": self.bucket_numel,
            "flat": [
                (buf.group_index, str(buf.dtype), buf.unit, buf.layout.local_numel)
                for buf in self.flat_groups
            ],
        }

    # -- the typed interface of fusedzero/state.py (checkpoints, importers, plan) -------------
    def shard_infos(self) -> list[ShardInfo]:
        """What this rank holds, one record per flat buffer (the order of `shard_state()`)."""
        return self.shards.shard_infos()

    def param_infos(self) -> list[ParamInfo]:
        """The trainable params in optimizer order."""
        return self.shards.param_infos(self.param_groups)

    def shard_state(self) -> ShardState:
        """This rank's values: master as a local-shard tensor (a copy where the params are
        their own master), the rule's state as live views. `step_count` is a host sync."""
        return self.shards.shard_state()

    def load_shard_state(self, st: ShardState) -> None:
        """Write `st` back; None fields are left as they are. Writing master rewrites the
        params derived from it and gathers them: a collective at stages 1-3."""
        self.shards.load_shard_state(st)

    def write_param_runs(self, read: Callable[[int, int, int], torch.Tensor]) -> bool:
        """Stage 3: write the params run by run as `read(i, a, b)` gives elements [a, b) of
        the i-th param's flattened full value (nothing staged; not a collective) and return
        True; below stage 3 write nothing and return False. See `ShardAccess`."""
        return self.shards.write_param_runs(self.params, read)
