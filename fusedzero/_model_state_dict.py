"""`model.state_dict()` and `model.load_state_dict()` under ZeroAdamW.

At stage 3 a freed unit's params are empty tensors (fusedzero/_zero3.py). There state_dict is a
collective, as FSDP's full state dict: every rank calls it (it gathers each unit that is free,
and frees it again after); load_state_dict writes each rank's shard alone (a collective only
when a unit was gathered as it began: it is gathered again after).
- state_dict: the full values, copied off the gathered storage (freed after, rewritten by every
  step). Without this it held the empty params, and torch.save wrote tensors that cannot be
  loaded back.
- load_state_dict: torch checks names and shapes against, and copies into, `LocalParam`s that
  write each rank's own runs (See [Note: loading into LocalParams] in fusedzero/_shard_init.py):
  the fp32 master straight from the given values (not from their cast to a bf16 param), and
  the param shard as the cast of that master, which is what the next gather reads. Nothing is
  gathered (it gathered the whole model on every rank). Without this torch refused the empty
  params (size mismatch). Each rank keeps its shard of the values *it* was given: give every
  rank the same state dict.

[Note: rank-0-only full state dict]
A full state dict is written by one rank, but `model.state_dict()` at stage 3 copies every unit
to the CPU on every rank: W copies of the model in host RAM, all but one thrown away.
`ZeroAdamW.full_state_dict(model, rank0_only=True)` keeps the copies on rank 0 alone: every
rank still joins each unit's gather (a collective), one unit's gathered storage at a time on
the device, but a rank other than 0 copies nothing and gets the non-param entries only
(buffers, extra state: what it already held, no copy), never an empty param. The integrations
(ZeroTrainer.save_model, ZeroStrategy) save through it.

Stages 0-2 keep full params, so torch's load needs no gather; `FullParamsLoad` only waits for a
param all-gather still in flight (it would land on the loaded values) and rewrites a separate
fp32 master (bf16 params) from the given values: before, the next step wrote the old master
back over what was loaded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, NamedTuple, Protocol

import torch
from torch import nn

from fusedzero._dtensor import local
from fusedzero._flat import FlatBuffer
from fusedzero._shard_init import ShardLoad


class Units(Protocol):
    """What these hooks use of `fusedzero._zero3.Zero3`."""

    modules: list[nn.Module]
    buffers: list[list[FlatBuffer]]

    def wait(self, u: int) -> None: ...
    def free(self, u: int) -> None: ...
    def free_units(self) -> list[int]: ...
    def unit_params(self, u: int) -> list[nn.Parameter]: ...


# What `model.state_dict()` at stage 3 does with the params: "copied": gather each unit, keep CPU
# copies; "gathered": join each unit's gather (a collective), keep nothing; "left_out": gather
# nothing, keep nothing (the non-param entries alone; no collective).
ParamsIn = Literal["copied", "gathered", "left_out"]


class _Load(NamedTuple):
    """One `load_state_dict` in progress at stage 3."""

    shards: ShardLoad  # the LocalParams standing in for the params
    regather: list[int]  # units gathered when it began


class UnitStateDict:
    """The state-dict hooks of stage 3, over the units of a `Zero3`."""

    def __init__(self, zero3: Units) -> None:
        self.z = zero3
        self._loads: list[_Load] = []  # per load in progress (nested loads: a stack)
        self.params: ParamsIn = "copied"

    @contextlib.contextmanager
    def params_in(self, params: ParamsIn) -> Iterator[None]:
        """`model.state_dict()` inside takes the params as `params` says (See [Note: rank-0-only
        full state dict])."""
        before, self.params = self.params, params
        try:
            yield
        finally:
            self.params = before

    def install(self, root: nn.Module) -> list[Any]:
        """Register the hooks on `root`; returns their handles."""
        # (Plain functions: torch tags the hook with an attribute, which a bound method refuses.)
        return [
            root.register_state_dict_pre_hook(lambda *a: self._save_pre(*a)),
            root.register_state_dict_post_hook(lambda *a: self._save_post(*a)),
            root.register_load_state_dict_pre_hook(lambda *a: self._load_pre(*a)),
            root.register_load_state_dict_post_hook(lambda *a: self._load_post(*a)),
        ]

    # -- state_dict -------------------------------------------------------------------------------
    def _save_pre(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        pass  # torch records the (possibly freed) params; `_save_post` puts their values in

    def _save_post(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
    ) -> None:
        """Each sharded param's entry (under every name of a tied one) becomes a CPU copy of its
        full value, unit by unit: one unit's gathered storage lives on the device at a time
        (the whole model at once was twice its size there: gathered, plus the copies). Or, by
        `self.params`, every param's entry leaves the state dict."""
        keys: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            if prefix + name in state_dict:
                keys.setdefault(id(p), []).append(prefix + name)
        free = set(self.z.free_units())
        for u in range(len(self.z.modules)):
            own = [p for p in self.z.unit_params(u) if id(p) in keys]
            if not own:
                continue
            if self.params == "left_out":
                continue
            self.z.wait(u)  # on every rank: the gather is a collective
            for p in own:
                if self.params != "copied":
                    continue
                # A copy: the gathered storage is freed below (and rewritten by every step).
                value = p.detach().to("cpu", copy=True)
                for k in keys[id(p)]:
                    state_dict[k] = value
            if u in free:
                self.z.free(u)
        if self.params != "copied":
            for k in [k for ks in keys.values() for k in ks]:
                del state_dict[k]

    # -- load_state_dict --------------------------------------------------------------------------
    def _load_pre(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        *rest: Any,
    ) -> None:
        if local_metadata.get("assign_to_params_buffers", False):
            raise RuntimeError(
                "model.load_state_dict(..., assign=True) under ZeroAdamW at stage 3 would replace "
                "the params it shards; call it without assign=, or set the weights with "
                "fusedzero.checkpoint.import_weights(opt, state_dict)"
            )
        free = set(self.z.free_units())
        gathered = [u for u in range(len(self.z.modules)) if u not in free]
        for u in gathered:
            self.z.free(u)  # stale after the load; one still gathering reads the shards
        buffers = [b for bufs in self.z.buffers for b in bufs]
        self._loads.append(_Load(ShardLoad(module, buffers), gathered))

    def _load_post(self, module: nn.Module, incompatible_keys: Any) -> None:
        load = self._loads.pop()
        load.shards.close()
        for u in load.regather:
            self.z.wait(u)


def without_params(module: nn.Module, state_dict: dict[str, Any]) -> dict[str, Any]:
    """`state_dict` less the entries of `module`'s params (under every name of a tied one)."""
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    return {k: v for k, v in state_dict.items() if k not in params}


def given_values(
    module: nn.Module, state_dict: dict[str, Any], prefix: str
) -> dict[int, torch.Tensor]:
    """id(param) -> its value in `state_dict` (a tied param under any of its names), where the
    shape matches; a shape torch will refuse (its error names it) is left out."""
    given: dict[int, torch.Tensor] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        t = state_dict.get(prefix + name)
        if id(p) not in given and isinstance(t, torch.Tensor) and t.shape == p.shape:
            given[id(p)] = t
    return given


def write_given(buffers: Iterable[FlatBuffer], given: dict[int, torch.Tensor]) -> None:
    """This rank's fp32 master (and the param copy derived from it) of each buffer from the
    given full values; params not given keep theirs."""
    with torch.no_grad():
        for buf in buffers:
            if not any(id(p) in given for p in buf.params):
                continue
            values = buf.read_master().clone()
            pos = {s.index: i for i, s in enumerate(buf.layout.params)}
            for seg in buf.layout.segments(buf.shard_rank):
                t = given.get(id(buf.params[pos[seg.param]]))
                if t is not None:
                    values[seg.local : seg.local + seg.length].copy_(
                        local(t).detach().reshape(-1)[seg.start : seg.start + seg.length]
                    )
            buf.write_master(values)


class FullParamsLoad:
    """The load hooks of stages 0-2 (see the module's note)."""

    def __init__(self, buffers: list[FlatBuffer], wait_params: Callable[[], None]) -> None:
        self.buffers = buffers
        self.wait_params = wait_params
        self._sources: list[dict[int, torch.Tensor]] = []

    def install(self, root: nn.Module) -> list[Any]:
        return [
            root.register_load_state_dict_pre_hook(lambda *a: self._pre(*a)),
            root.register_load_state_dict_post_hook(lambda *a: self._post(*a)),
        ]

    def _pre(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *rest: Any) -> None:
        self.wait_params()
        self._sources.append(given_values(module, state_dict, prefix))

    def _post(self, module: nn.Module, incompatible_keys: Any) -> None:
        given = self._sources.pop()
        write_given([b for b in self.buffers if b.master is not None], given)
