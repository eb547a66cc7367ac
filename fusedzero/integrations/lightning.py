"""ZeroStrategy: Lightning 2.x with ZeroAdamW as its data parallelism.

    trainer = L.Trainer(strategy=ZeroStrategy(stage=2), accelerator="cpu", devices=2,
                        gradient_clip_val=1.0, accumulate_grad_batches=2)
    trainer.fit(module)                     # the LightningModule as it is

The LightningModule is unchanged. Its `configure_optimizers` returns a plain
`torch.optim.AdamW` (param groups, hyper-parameters, lr schedulers as usual); the strategy builds
ZeroAdamW with the same groups and settings in its place (see [Note: the optimizer swap]).
`gradient_clip_val` becomes ZeroAdamW's `max_grad_norm` (algorithm "norm"),
`accumulate_grad_batches` works as under DDP (Lightning divides the loss; ZeroAdamW sums
micro-batches and averages ranks), and the model is never wrapped in DDP. Checkpoints are
folders in our sharded format (`fusedzero.checkpoint`) plus `lightning.pt` (loops, callbacks,
schedulers, buffers):
`trainer.save_checkpoint(path)`, `ModelCheckpoint` and `fit(ckpt_path=path)` use them at any
world size and stage (`validate`/`test`/`predict(ckpt_path=...)` read their full weights).
`trainer.strategy.lightning_module_state_dict()` gives the full params at every stage (a
collective, as Lightning's FSDP strategy with full state dicts); after `fit` the optimizer is
closed and the module holds its full, trained params. After a `fit` that raised, the optimizer is
abandoned without a collective and the params keep their shapes but not their values (stage 3:
NaN): a new `Trainer(...).fit(module, ckpt_path=...)` in the same process loads a checkpoint
into them. See [Note: teardown after a failure].

Constructor: `ZeroStrategy(stage=1, **kwargs)`: DDPStrategy's own arguments (accelerator,
cluster_environment, process_group_backend, timeout, ...) and any ZeroAdamW keyword (precision=,
wire=, groups=, sharding=, device=, ...); DDP's own keywords are refused (no DDP is built), and a
keyword of ZeroAdamW's old flat signature (`param_dtype=`, ...) is refused naming its record
(`precision=fusedzero.Precision(param_dtype=...)`). Refused in one line too: an optimizer
other than AdamW/ZeroAdamW/ZeroMuon, several optimizers but a Muon with an AdamW,
`amsgrad=True`, `gradient_clip_algorithm="value"`, manual optimization, a
precision other than "32-true" (ZeroAdamW's `precision=fusedzero.Precision(param_dtype=
torch.bfloat16)` is the bf16 path).

Muon: `configure_optimizers` returning a `torch.optim.Muon` and a `torch.optim.AdamW` (disjoint
params) becomes one ZeroMuon, the Muon's groups its Muon groups and the AdamW's its AdamW groups,
both stepping on every optimizer step (Lightning's own check, which refuses several optimizers
under automatic optimization, is skipped for that pair); each optimizer's schedulers drive its
own groups inside the ZeroMuon. Every stage runs at any world size (at stages 1-3 the owner
layout keeps each matrix whole on one rank); checkpoints hold ZeroMuon's state as ZeroAdamW's.

[Note: the optimizer swap] ZeroAdamW owns flat buffers, hooks and collectives from its constructor
on, so it is built once, in `setup_optimizers`, from what `configure_optimizers` returned: the
AdamW's param groups with their hyper-parameters (and `initial_lr`, which schedulers read), its
defaults, the Trainer's clipping. The AdamW never steps; its lr schedulers are re-pointed at the
ZeroAdamW (`scheduler.optimizer`), where they keep writing each group's lr.

[Note: teardown after a failure] Lightning tears the strategy down after a fit that raised too
(`_call_and_handle_interrupt`: `on_exception`, then `teardown`, then the error goes on). Closing
ZeroAdamW there gathered the params unit by unit (stage 3) and waited for collectives in flight;
when the error was on one rank only, those collectives met the other ranks' forward gathers
instead (mismatched; on NCCL the failed rank could block there rather than exit, and torchrun
never saw the failure). So after `on_exception` the strategy abandons the optimizer instead
(`ZeroAdamW.abandon`: hooks removed, no collective, no wait) and the error reaches the launcher.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import tempfile
from collections.abc import Iterator
from typing import Any
from unittest import mock

import safetensors.torch
import torch

from fusedzero import checkpoint
from fusedzero._model_state_dict import without_params
from fusedzero._validate import check_stage
from fusedzero.integrations._common import (
    check_zero_kwargs,
    full_state_dict,
    import_framework,
)
from fusedzero.optim import ZeroAdamW, ZeroMuon, ZeroOptimizer

L = import_framework("lightning.pytorch", "lightning", "fusedzero.integrations.lightning")
from lightning.pytorch.core import optimizer as pl_optimizer  # noqa: E402
from lightning.pytorch.plugins.precision import Precision  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

__all__ = ["META_FILE", "ZeroStrategy"]

META_FILE = "lightning.pt"  # in a checkpoint folder: what Lightning saves besides params and state

# The ZeroAdamW keywords the strategy sets itself, and where each comes from.
_TAKEN = {
    "params": "configure_optimizers (the AdamW's param groups)",
    "module": "the LightningModule",
    "lr": "configure_optimizers (the AdamW's lr)",
    "betas": "configure_optimizers (the AdamW's betas)",
    "eps": "configure_optimizers (the AdamW's eps)",
    "weight_decay": "configure_optimizers (the AdamW's weight_decay)",
    "maximize": "configure_optimizers (the AdamW's maximize)",
    "max_grad_norm": "Trainer(gradient_clip_val=...)",
}
_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "maximize", "initial_lr")
# A torch.optim.Muon group's hyper-parameters, as ZeroMuon's Muon groups take them.
_MUON_KEYS = (
    "lr",
    "weight_decay",
    "momentum",
    "nesterov",
    "ns_coefficients",
    "eps",
    "ns_steps",
    "adjust_lr_fn",
    "initial_lr",
)
_SUPPORTED = (
    "return a torch.optim.AdamW, a torch.optim.Muon with a torch.optim.AdamW (over disjoint "
    "params), or a ZeroAdamW/ZeroMuon"
)


class ZeroStrategy(DDPStrategy):
    """Lightning's DDP strategy without the DDP wrapper: ZeroAdamW shards and reduces (see the
    module docstring). `stage` is ZeroAdamW's (0-3)."""

    strategy_name = "fusedzero"

    def __init__(self, stage: int = 1, **kwargs: Any) -> None:
        own = inspect.signature(DDPStrategy.__init__).parameters
        zero_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k not in own}
        # (DDPStrategy passes unknown keywords on to DDP, which ZeroStrategy never builds.)
        check_zero_kwargs(zero_kwargs, _TAKEN, "ZeroStrategy")
        check_stage(stage, "ZeroStrategy")
        super().__init__(**kwargs)
        self.zero_stage = stage
        self.zero_kwargs = zero_kwargs
        self.zero_optimizer: ZeroOptimizer | None = None
        self._max_grad_norm: float | None = None  # Trainer(gradient_clip_val=...), at setup
        self._failed = False  # on_exception ran: see [Note: teardown after a failure]

    # -- setup --------------------------------------------------------------------------------
    def configure_ddp(self) -> None:
        pass  # no DDP wrapper: ZeroAdamW reduces the grads

    def setup(self, trainer: L.Trainer) -> None:
        if type(self.precision_plugin) is not Precision:
            raise ValueError(
                f"ZeroStrategy runs precision='32-true' (got "
                f"{type(self.precision_plugin).__name__}); for bf16 params pass "
                "ZeroStrategy(precision=fusedzero.Precision("
                "param_dtype=torch.bfloat16))"
            )
        algorithm = trainer.gradient_clip_algorithm
        if algorithm not in (None, "norm"):
            # Lightning holds a GradClipAlgorithmType (a str enum): print its value.
            raise ValueError(
                f"ZeroStrategy clips by norm only (gradient_clip_algorithm="
                f"{str(getattr(algorithm, 'value', algorithm))!r}); use 'norm'"
            )
        self._max_grad_norm = trainer.gradient_clip_val or None
        super().setup(trainer)
        # Clipping happens in ZeroAdamW's step (max_grad_norm); Lightning's own clip would read
        # the placeholder grads.
        self.precision_plugin.clip_gradients = _clipped_in_step

    def setup_optimizers(self, trainer: L.Trainer) -> None:
        """See [Note: the optimizer swap]."""
        lm = self.lightning_module
        if not lm.automatic_optimization:
            raise ValueError(
                "ZeroStrategy needs automatic optimization (ZeroAdamW's step runs "
                "where Lightning's does); manual optimization is not supported"
            )
        # Lightning refuses several optimizers under automatic optimization; a Muon with an
        # AdamW is one ZeroMuon here, and any other pair is refused below.
        with mock.patch.object(
            pl_optimizer, "_validate_multiple_optimizers_support", lambda *args: None
        ):
            super().setup_optimizers(trainer)
        olds = list(self.optimizers)
        kinds = sorted(type(o).__name__ for o in olds)
        if len(olds) == 1 and isinstance(olds[0], ZeroAdamW | ZeroMuon):
            zero = olds[0]
            clip = self._max_grad_norm
            if clip is not None and clip != zero.max_grad_norm:
                raise ValueError(
                    f"configure_optimizers returned a {type(zero).__name__} with max_grad_norm="
                    f"{zero.max_grad_norm} but Trainer(gradient_clip_val={clip}): the "
                    f"{type(zero).__name__} clips; pass max_grad_norm={clip} to it, or leave "
                    f"gradient_clip_val out"
                )
        elif len(olds) == 1:
            zero = self._to_zero(olds[0])
        elif kinds == ["AdamW", "Muon"] and all(
            type(o).__module__.startswith("torch.optim") for o in olds
        ):
            zero = self._to_muon(olds, trainer)
        else:
            raise TypeError(
                f"ZeroStrategy got {len(olds)} optimizers from configure_optimizers "
                f"({', '.join(kinds)}): {_SUPPORTED}"
            )
        self.zero_optimizer = zero
        self.optimizers = [zero]
        start = 0
        for old in olds:
            stop = start + len(old.param_groups)
            new = zero if len(olds) == 1 else _GroupsOf(zero, start, stop)
            for cfg in self.lr_scheduler_configs:
                _repoint(cfg.scheduler, old, new)
            start = stop

    def _to_muon(self, opts: list[torch.optim.Optimizer], trainer: L.Trainer) -> ZeroMuon:
        """One ZeroMuon: the Muon's param groups as its Muon groups, the AdamW's as its AdamW
        groups, each with its hyper-parameters, in the order configure_optimizers gave them."""
        groups = []
        for opt in opts:
            muon = type(opt) is torch.optim.Muon
            if not muon and any(g.get("amsgrad") for g in opt.param_groups):
                raise ValueError(
                    "ZeroStrategy: AdamW(amsgrad=True) has no ZeroMuon counterpart; drop amsgrad"
                )
            keys = _MUON_KEYS if muon else _GROUP_KEYS
            groups += [
                {"params": g["params"], "use_muon": muon, **{k: g[k] for k in keys if k in g}}
                for g in opt.param_groups
            ]
        zero = ZeroMuon(
            groups,
            stage=self.zero_stage,
            module=self.lightning_module,
            max_grad_norm=self._max_grad_norm,
            **self.zero_kwargs,
        )
        assert len(zero.param_groups) == len(groups), "ZeroMuon dropped a param group"
        return zero

    def _to_zero(self, opt: torch.optim.Optimizer) -> ZeroAdamW:
        if type(opt) is not torch.optim.AdamW:
            raise TypeError(
                f"ZeroStrategy turns a torch.optim.AdamW from configure_optimizers "
                f"into ZeroAdamW; got {type(opt).__module__}.{type(opt).__name__}: "
                f"return torch.optim.AdamW (or a ZeroAdamW) instead"
            )
        if any(g.get("amsgrad") for g in opt.param_groups):
            raise ValueError(
                "ZeroStrategy: AdamW(amsgrad=True) has no ZeroAdamW counterpart; drop amsgrad"
            )
        groups = [
            {"params": g["params"], **{k: g[k] for k in _GROUP_KEYS if k in g}}
            for g in opt.param_groups
        ]
        d = opt.defaults
        return ZeroAdamW(
            groups,
            lr=d["lr"],
            betas=d["betas"],
            eps=d["eps"],
            weight_decay=d["weight_decay"],
            maximize=d.get("maximize", False),
            stage=self.zero_stage,
            module=self.lightning_module,
            max_grad_norm=self._max_grad_norm,
            **self.zero_kwargs,
        )

    # -- steps: through the module's own __call__, so its forward hooks run -------------------
    # (stage 3 gathers the params outside units in the root module's forward pre-hook; the end
    # of backward is found from the output's grad). Lightning's redirection patches `forward`
    # to the step method for one call.
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._redirect("training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._redirect("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._redirect("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._redirect("predict_step", *args, **kwargs)

    def _redirect(self, name: str, *args: Any, **kwargs: Any) -> Any:
        lm = self.lightning_module
        return self._forward_redirection(lm, lm, name, *args, **kwargs)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Micro-batches before the last of an accumulation: ZeroAdamW's no_sync (a speed
        switch at stages 0-1; the result is the same without it)."""
        if self.zero_optimizer is None:
            yield
            return
        with self.zero_optimizer.no_sync():
            yield

    # -- state --------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """What Lightning's checkpoint holds as `state_dict`. While fitting: the non-param
        entries alone, gathering nothing (`save_checkpoint` writes the params sharded and
        dropped these; at stage 3 every ModelCheckpoint save gathered the whole model on every
        rank for nothing). Without a live optimizer: the module's own state dict. For the full
        weights during fit call `full_state_dict()`."""
        opt = self._live_optimizer()
        if opt is not None:
            return opt.state_dict_without_params(self.lightning_module)
        return self.lightning_module.state_dict()

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, Any]:
        """The module's state dict with every param at its full value, at every stage.
        Collective: call it on every rank. `rank0_only=True`: only global rank 0 keeps the
        params, the others get the non-param entries (See [Note: rank-0-only full state dict]
        in fusedzero/_model_state_dict.py)."""
        return full_state_dict(self._live_optimizer(), self.lightning_module, rank0_only=rank0_only)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}  # the sharded checkpoint holds it (save_checkpoint)

    def save_checkpoint(
        self, checkpoint_dict: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        """`filepath` becomes a folder: our sharded checkpoint (every rank writes its shard) and
        `lightning.pt` (rank 0: everything else Lightning saves, buffers included)."""
        opt = self._live_optimizer()
        if opt is None:
            raise RuntimeError(
                "ZeroStrategy saves checkpoints while fitting (its optimizer holds "
                "the params); after fit, save the module's state_dict yourself"
            )
        path = os.fspath(filepath)
        checkpoint.save(opt, path, step=int(checkpoint_dict.get("global_step", 0)), keep_last=1)
        if self.is_global_zero:
            meta = dict(checkpoint_dict)
            meta["state_dict"] = without_params(
                self.lightning_module, checkpoint_dict.get("state_dict", {})
            )
            meta["optimizer_states"] = [{"fusedzero": "sharded, in this folder"}]
            torch.save(meta, os.path.join(path, META_FILE))

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the optimizer must exist: load_checkpoint restores it

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint did

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Fitting: params, moments, step and hyper-parameters into ZeroAdamW (any world size and
        stage); returns what Lightning restores itself (loops, callbacks, schedulers, buffers).
        Validating, testing, predicting (no optimizer, the module whole): the full weights go
        into the returned state dict, for Lightning to load."""
        path = os.fspath(checkpoint_path)
        meta_file = os.path.join(path, META_FILE)
        if not os.path.isfile(meta_file):
            raise FileNotFoundError(
                f"{path} is not a ZeroStrategy checkpoint (a folder with "
                f"{META_FILE}); pass one that trainer.save_checkpoint or "
                f"ModelCheckpoint wrote under ZeroStrategy"
            )
        meta = torch.load(meta_file, map_location="cpu", weights_only=bool(weights_only))
        opt = self._live_optimizer()
        if opt is None:
            meta["state_dict"] = {**meta["state_dict"], **_full_weights(path)}
        else:
            # Lightning leaves the RNG alone on resume (as DDP's resumed fit does).
            checkpoint.load(opt, path, restore_rng=False)
        return meta

    def load_model_state_dict(self, checkpoint_dict: Any, strict: bool = True) -> None:
        # Fitting: the params came with load_checkpoint and this dict holds the buffers.
        self.lightning_module.load_state_dict(
            checkpoint_dict["state_dict"], strict=strict and self._live_optimizer() is None
        )

    def load_optimizer_state_dict(self, checkpoint_dict: Any) -> None:
        pass  # load_checkpoint restored ZeroAdamW

    def _live_optimizer(self) -> ZeroOptimizer | None:
        opt = self.zero_optimizer
        return None if opt is None or opt.closed else opt

    def on_exception(self, exception: BaseException) -> None:
        """Lightning calls this on the rank where fit/validate/... raised (KeyboardInterrupt
        included), before `teardown`: see [Note: teardown after a failure]."""
        self._failed = True
        super().on_exception(exception)

    def teardown(self) -> None:
        """After a fit that finished: close ZeroAdamW (the module keeps its full params, stage 3
        included), so a later fit can build a new one on the same module. After one that raised
        on this rank: abandon it, without a collective (its hooks removed, the params full-shaped
        but meaningless, NaN at stage 3, until a later `fit(ckpt_path=...)` loads a checkpoint).
        See [Note: teardown after a failure]."""
        opt = self.zero_optimizer
        if opt is not None and self._failed:
            opt.abandon()
        elif opt is not None:
            opt.close()
        self._failed = False
        super().teardown()


def _full_weights(path: str) -> dict[str, torch.Tensor]:
    """Every param of the sharded checkpoint at `path`, full, fp32 (read on this rank alone)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "model.safetensors")
        checkpoint.export(path, out)
        return safetensors.torch.load_file(out)


def _clipped_in_step(*args: Any, **kwargs: Any) -> None:
    """Lightning's clip_gradients under ZeroStrategy: ZeroAdamW(max_grad_norm=...) clips."""


class _GroupsOf:
    """One of several optimizers configure_optimizers returned, inside the ZeroMuon that took
    their place, as its lr scheduler sees it: its param groups are the ZeroMuon's at
    [start, stop) (read on every access: `load_state_dict` replaces the group dicts), the rest
    is the ZeroMuon's."""

    def __init__(self, opt: ZeroOptimizer, start: int, stop: int) -> None:
        self._opt, self._start, self._stop = opt, start, stop

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._opt.param_groups[self._start : self._stop]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._opt, name)


def _repoint(scheduler: Any, old: torch.optim.Optimizer, new: Any) -> None:
    """A scheduler (and those it chains) that drove `old` drives `new` from now on."""
    if getattr(scheduler, "optimizer", None) is old:
        scheduler.optimizer = new
    for inner in getattr(scheduler, "_schedulers", []):
        _repoint(inner, old, new)
