"""Reading and writing a rank's optimizer state through the records of fusedzero/state.py.

`ShardAccess` is what `ZeroAdamW.shard_infos / param_infos / shard_state / load_shard_state`
delegate to: it sees the flat buffers, the step scalars and the param all-gather, nothing else.
"""
from __future__ import annotations

from typing import Any

import torch

from fusedzero.flat import FlatBuffer
from fusedzero.param_sync import ParamSync
from fusedzero.scalars import StepScalars
from fusedzero.state import ParamInfo, ShardInfo, ShardState


class ShardAccess:
    def __init__(self, buffers: list[FlatBuffer], scalars: StepScalars,
                 param_sync: ParamSync) -> None:
        self.buffers = buffers
        self.scalars = scalars
        self.param_sync = param_sync

    def shard_infos(self) -> list[ShardInfo]:
        return [ShardInfo(group_index=b.group_index, dtype=b.dtype, unit=b.unit,
                          layout=b.layout, shard_rank=b.shard_rank) for b in self.buffers]

    def param_infos(self, param_groups: list[dict[str, Any]]) -> list[ParamInfo]:
        # Shapes from the layout: a stage-3 param is an empty tensor while its unit is freed.
        slots = {s.index: (s, b) for b in self.buffers for s in b.layout.params}
        out = []
        for gi, g in enumerate(param_groups):
            for _ in g["params"]:
                s, b = slots[len(out)]
                out.append(ParamInfo(index=s.index, name=s.name, shape=s.shape, dtype=b.dtype,
                                     group_index=gi))
        return out

    def master(self, buf: FlatBuffer) -> torch.Tensor:
        # fp32 params are their own master: let the param all-gather in flight land first.
        self.param_sync.wait()
        return buf.read_master()

    def set_master(self, buf: FlatBuffer, values: torch.Tensor) -> None:
        """Write master and the params derived from it, then gather them (stages 1-2)."""
        self.param_sync.wait()  # the write must not race an all-gather in flight
        buf.write_master(values)
        self.param_sync.gather()
        self.param_sync.wait()

    def shard_state(self) -> ShardState:
        scaler = self.scalars.scaler
        return ShardState(master=[self.master(b) for b in self.buffers],
                          exp_avg=[b.exp_avg for b in self.buffers],
                          exp_avg_sq=[b.exp_avg_sq for b in self.buffers],
                          step_count=float(self.scalars.step.reshape(-1)[0]),  # a host sync
                          scaler=None if scaler is None else scaler.values())

    def load_shard_state(self, st: ShardState) -> None:
        n = len(self.buffers)
        for name in ("master", "exp_avg", "exp_avg_sq"):
            values = getattr(st, name)
            if values is not None and len(values) != n:
                raise ValueError(f"shard state has {len(values)} {name} buffers, the "
                                 f"optimizer has {n}")
        with torch.no_grad():
            for i, buf in enumerate(self.buffers):
                if st.exp_avg is not None:
                    buf.exp_avg.copy_(st.exp_avg[i])
                if st.exp_avg_sq is not None:
                    buf.exp_avg_sq.copy_(st.exp_avg_sq[i])
            if st.master is not None:
                self.param_sync.wait()
                for buf, values in zip(self.buffers, st.master):
                    buf.write_master(values)
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
        assert st.master is not None and st.exp_avg is not None and st.exp_avg_sq is not None
        flat = [{"master": m.clone(), "exp_avg": a.clone(), "exp_avg_sq": v.clone()}
                for m, a, v in zip(st.master, st.exp_avg, st.exp_avg_sq)]
        state: dict[str, Any] = {"step": self.scalars.step.clone(), "flat": flat}
        if self.scalars.scaler is not None:
            state["scaler"] = self.scalars.scaler.state_dict()
        return state

    def load_flat_state(self, state: dict[str, Any]) -> None:
        flat = state["flat"]
        if len(flat) != len(self.buffers):
            raise ValueError(f"state dict has {len(flat)} flat buffers, optimizer has "
                             f"{len(self.buffers)}")
        with torch.no_grad():
            self.scalars.step.copy_(state["step"])
            if self.scalars.scaler is not None and "scaler" in state:
                self.scalars.scaler.load_state_dict(state["scaler"])
        self.load_shard_state(ShardState(master=[d["master"] for d in flat],
                                         exp_avg=[d["exp_avg"] for d in flat],
                                         exp_avg_sq=[d["exp_avg_sq"] for d in flat]))

    def state_dict(self, param_groups: list[dict[str, Any]],
                   layout_key: dict[str, Any]) -> dict[str, Any]:
        groups = []
        index = 0
        for g in param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(d)
        return {"state": self.flat_state(), "param_groups": groups, "layout": layout_key}

    def load_state_dict(self, state_dict: dict[str, Any], param_groups: list[dict[str, Any]],
                        layout_key: dict[str, Any]) -> None:
        key = state_dict.get("layout")
        if key != layout_key:
            raise ValueError(f"state dict was saved with layout {key}, this optimizer has "
                             f"{layout_key}; use fusedzero.checkpoint to load across "
                             "world sizes or stages")
        groups = state_dict["param_groups"]
        if len(groups) != len(param_groups):
            raise ValueError(f"state dict has {len(groups)} param groups, optimizer has "
                             f"{len(param_groups)}")
        for mine, saved in zip(param_groups, groups):
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError("param group sizes differ between state dict and optimizer")
            for k, v in saved.items():
                if k != "params":
                    mine[k] = v
        self.load_flat_state(state_dict["state"])
