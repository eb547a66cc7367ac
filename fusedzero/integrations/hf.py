"""ZeroTrainer: the transformers `Trainer` with ZeroAdamW as its data parallelism.

    trainer = ZeroTrainer(model=model, args=TrainingArguments(...), train_dataset=ds, stage=2)
    trainer.train()                        # under torchrun: every rank runs the same script

The constructor is the Trainer's, plus `stage=` and any ZeroAdamW keyword (`sharding=`,
`precision=`, ...). What the Trainer does with its own optimizer, ZeroTrainer does with ZeroAdamW:

- the optimizer: ZeroAdamW over the Trainer's own two groups (weight decay on all but biases and
  norms, `get_decay_parameter_names`), lr, adam betas and eps from `TrainingArguments`, and
  `max_grad_norm` as its clipping; the lr scheduler is the Trainer's (`lr_scheduler_type`).
- the model is never wrapped in DDP or FSDP (see [Note: the Trainer without DDP]).
- grads: the Trainer divides the loss by the micro-batches (or normalises by the tokens of the
  whole step) and ZeroAdamW averages over ranks, as DDP does: nothing is averaged twice. The
  micro-batches before the last of a step run under ZeroAdamW's `no_sync`.
- `grad_norm` in the logs is `opt.grad_norm`, the norm before clipping, as the Trainer logs.
- checkpoints: each `checkpoint-N/` holds the model (`save_pretrained`, full weights), the
  Trainer's state and scheduler, and our sharded optimizer checkpoint in `checkpoint-N/zero/`;
  `resume_from_checkpoint` loads it at any world size and stage. `save_model` writes a folder
  `from_pretrained` loads (the params gathered on every rank, kept and written by rank 0 alone):
  a collective, called on every rank, never under `is_world_process_zero()` (at stage 3 that
  blocks).
- stage 3, after training too: the params stay sharded and every forward gathers them with all
  ranks, so `model.generate(...)` needs `synced_gpus=True` (a rank whose sequences ended early
  keeps running forwards while the others generate; without it they wait for it forever).

`muon=dict(lr=...)`: ZeroMuon in ZeroAdamW's place, Muon on `muon_param_groups(model)`'s hidden
matrices with those hyper-parameters, AdamW on the rest with the arguments' settings (the
Trainer's decay split), at every stage and world size (stages 1-3 keep each matrix whole on
one rank: the owner layout); checkpoints hold its state as ZeroAdamW's.

A ZeroAdamW or ZeroMuon the user built (`module=model`) may come in `optimizers=(opt, None)`; its
`max_grad_norm` must equal the arguments'. Not supported, each refused in one line:
`deepspeed=`/`fsdp=` (ZeroAdamW is the sharding), `fp16=True` (the Trainer's GradScaler reads
`.grad`; `bf16=True` autocast works), `bf16_full_eval`/`fp16_full_eval` (evaluate() would cast the
params ZeroAdamW owns), an `optim` other than "adamw_torch"/"adamw_torch_fused" (the default),
`optimizers=`/`optimizer_cls_and_kwargs=` with another optimizer, a ZeroAdamW keyword the
arguments set.

[Note: the Trainer without DDP] Under torchrun the Trainer prepares the model with Accelerate,
which wraps it in DDP: every grad was then reduced twice (stage 0), DDP's reducer read the
placeholder grads (stage 2) and the sharded params (stage 3), and its `clip_grad_norm_` read them
too. ZeroTrainer's Accelerator prepares the model as for evaluation (autocast, no wrapper) and
without device placement: the Trainer placed it before ZeroAdamW was built, and on CPU ranks
Accelerate's `model.to("cpu:0")` copied every param off ZeroAdamW's flat buffers (the steps then
updated buffers the model no longer read; "cpu:0" is not the params' "cpu", so `.to` copies). The
Trainer's own move in its constructor is skipped for the same reason when the user passes a
ZeroAdamW in `optimizers=`. The optimizer is prepared without device placement too (it would round-
trip ZeroAdamW's state dict); the Trainer's clipping and norm are left to ZeroAdamW's step. The
dataloaders are still sharded per rank by Accelerate, as with DDP.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from typing import Any

import torch
from torch import nn

from fusedzero import checkpoint
from fusedzero._muon_groups import muon_param_groups
from fusedzero._validate import check_stage
from fusedzero.integrations._common import (
    check_zero_kwargs,
    full_state_dict,
    import_framework,
)
from fusedzero.optim import ZeroAdamW, ZeroMuon, ZeroOptimizer

transformers = import_framework("transformers", "hf", "fusedzero.integrations.hf")
if not all(hasattr(transformers.Trainer, m) for m in ("_clip_grad_norm", "_get_grad_norm")):
    raise ImportError(
        f"fusedzero.integrations.hf needs transformers>=5.24 (its Trainer's "
        f"_clip_grad_norm/_get_grad_norm), found {transformers.__version__}; "
        f"pip install 'fusedzero[hf]'"
    )

__all__ = ["ZERO_DIR", "ZeroTrainer"]

# The folder inside each checkpoint-N/ that holds our sharded checkpoint (fusedzero.checkpoint).
ZERO_DIR = "zero"
_SCHEDULER = "scheduler.pt"  # the Trainer's own name for its scheduler state
# The `optim=` values ZeroAdamW stands in for: torch's AdamW, whose update it computes
# (adamw_torch_fused is the default from torch 2.8 on). Every other name, AdamW-like ones
# included (adamw_8bit, paged_adamw_*, galore_adamw*, schedule_free_adamw, ...), is another
# update, refused rather than silently replaced.
_TORCH_ADAMW = frozenset({"adamw_torch", "adamw_torch_fused"})

# ZeroAdamW keywords ZeroTrainer sets itself, and where each comes from.
_TAKEN = {
    "params": "the model (the Trainer's param groups)",
    "module": "the model",
    "lr": "TrainingArguments(learning_rate=...)",
    "betas": "TrainingArguments(adam_beta1=..., adam_beta2=...)",
    "eps": "TrainingArguments(adam_epsilon=...)",
    "weight_decay": "TrainingArguments(weight_decay=...)",
    "max_grad_norm": "TrainingArguments(max_grad_norm=...)",
}


class ZeroTrainer(transformers.Trainer):
    """`transformers.Trainer` with ZeroAdamW (see the module docstring). `stage` is ZeroAdamW's
    stage (0-3); every other keyword ZeroAdamW takes is passed to it as given.

    `muon`: train with ZeroMuon instead, Muon on the hidden matrices with these Muon
    hyper-parameters (`torch.optim.Muon`'s: lr, weight_decay, momentum, ...; `{}` for its
    defaults), AdamW on the rest (`muon_param_groups`) with the arguments' settings."""

    def __init__(
        self, *args: Any, stage: int = 1, muon: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        signature = inspect.signature(transformers.Trainer.__init__)
        zero_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k not in signature.parameters}
        check_zero_kwargs(zero_kwargs, _TAKEN, "ZeroTrainer")
        check_stage(stage, "ZeroTrainer")
        _refuse_optimizers(kwargs)
        if muon is not None and kwargs.get("optimizers", (None, None))[0] is not None:
            raise TypeError(
                "ZeroTrainer got muon= and optimizers=: muon= builds the optimizer; pass one "
                "of them"
            )
        # Before the Trainer's own setup, which builds Accelerate's plugins from them.
        training_args = signature.bind_partial(self, *args, **kwargs).arguments.get("args")
        if training_args is not None:
            _check_args(training_args)
        self.zero_stage = stage
        self.zero_kwargs = zero_kwargs
        self.zero_muon = None if muon is None else dict(muon)
        # A ZeroAdamW/ZeroMuon the user built (checked above), or ours once create_optimizer
        # runs.
        self.zero_optimizer: ZeroOptimizer | None = (kwargs.get("optimizers") or (None, None))[0]
        # num_parameters(exclude_embeddings=True) of the whole model, counted before stage 3
        # empties the params (the Trainer's flos count reads it on every micro-batch).
        self._dense_params: int | None = None
        super().__init__(*args, **kwargs)
        clip = _max_grad_norm(self.args)
        if self.zero_optimizer is not None and self.zero_optimizer.max_grad_norm != clip:
            raise ValueError(
                f"ZeroTrainer got a {type(self.zero_optimizer).__name__} with max_grad_norm="
                f"{self.zero_optimizer.max_grad_norm} and TrainingArguments("
                f"max_grad_norm={self.args.max_grad_norm}): the optimizer clips; "
                f"give both the same value (0 in the arguments for None)"
            )

    # -- the model and optimizer as Accelerate prepares them ---------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        """See [Note: the Trainer without DDP]."""
        super().create_accelerator_and_postprocess()
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError(
                "ZeroTrainer cannot run under Accelerate's DeepSpeed or FSDP plugin "
                "(an `accelerate launch` config): ZeroAdamW shards the model itself; "
                "launch with torchrun or `accelerate launch` without them"
            )
        acc = self.accelerator
        prepare_model, prepare_optimizer = acc.prepare_model, acc.prepare_optimizer

        def model_without_wrapper(
            model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
        ) -> nn.Module:
            return prepare_model(model, device_placement=False, evaluation_mode=True)

        def optimizer_in_place(
            optimizer: torch.optim.Optimizer, device_placement: bool | None = None
        ) -> Any:
            return prepare_optimizer(optimizer, device_placement=False)

        def no_sync(model: nn.Module) -> contextlib.AbstractContextManager[None]:
            # Micro-batches before the last of a step: ZeroAdamW's no_sync (a speed switch at
            # stages 0-1, the result is the same without it); Accelerate's would look for DDP's.
            opt = self.zero_optimizer
            return contextlib.nullcontext() if opt is None else opt.no_sync()

        acc.prepare_model = model_without_wrapper
        acc.prepare_optimizer = optimizer_in_place
        acc.no_sync = no_sync

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """Not while a live ZeroAdamW holds this model's params (a user-built one, passed in
        `optimizers=`): see [Note: the Trainer without DDP]. The model is on its device already:
        ZeroAdamW was built on it. Any other model is moved as the Trainer moves it: the new one
        `model_init` builds for a second `train()` (the ZeroAdamW of the first holds the old
        model), or one whose ZeroAdamW was closed."""
        opt = self.zero_optimizer
        if opt is None or opt.closed or opt.module is not model:
            super()._move_model_to_device(model, device)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """ZeroAdamW over the Trainer's decay / no-decay groups, hyper-parameters from args."""
        if self.optimizer is None:
            model = self.model if model is None else model
            decay = set(self.get_decay_parameter_names(model))
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            groups = [
                {
                    "params": [p for n, p in named if n in decay],
                    "weight_decay": self.args.weight_decay,
                },
                {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
            ]
            a = self.args
            if hasattr(model, "num_parameters"):
                self._dense_params = model.num_parameters(exclude_embeddings=True)
            if self.zero_muon is not None:
                self.zero_optimizer = self._create_muon(model, decay)
                self.optimizer = self.zero_optimizer
                return self.optimizer
            self.zero_optimizer = ZeroAdamW(
                [g for g in groups if g["params"]],
                lr=a.learning_rate,
                betas=(a.adam_beta1, a.adam_beta2),
                eps=a.adam_epsilon,
                weight_decay=a.weight_decay,
                stage=self.zero_stage,
                module=model,
                max_grad_norm=_max_grad_norm(a),
                **self.zero_kwargs,
            )
            self.optimizer = self.zero_optimizer
        return self.optimizer

    def _create_muon(self, model: nn.Module, decay: set[str]) -> ZeroMuon:
        """ZeroMuon: `muon_param_groups(model)`'s Muon group with `self.zero_muon`, its AdamW
        group split as the Trainer splits its params (weight decay on all but biases and norms),
        with the arguments' lr, betas, eps and weight decay."""
        a = self.args
        muon, *adamw = muon_param_groups(model, muon=self.zero_muon)
        assert muon["use_muon"], "the model has no hidden matrices for Muon"
        named = {id(p): n for n, p in model.named_parameters()}
        rest = [p for g in adamw for p in g["params"]]
        hyper = dict(lr=a.learning_rate, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_epsilon)
        groups = [muon] + [
            {"params": ps, "use_muon": False, "weight_decay": wd, **hyper}
            for ps, wd in (
                ([p for p in rest if named[id(p)] in decay], a.weight_decay),
                ([p for p in rest if named[id(p)] not in decay], 0.0),
            )
            if ps
        ]
        opt = ZeroMuon(
            groups,
            stage=self.zero_stage,
            module=model,
            max_grad_norm=_max_grad_norm(a),
            **self.zero_kwargs,
        )
        return opt

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """The Trainer's count (6 x tokens x non-embedding params) with the params counted
        whole: at stage 3 a param outside a forward is empty (the count was 0)."""
        name = getattr(self.model, "main_input_name", "input_ids")
        if self._dense_params is None or name not in inputs:
            return super().floating_point_ops(inputs)
        return 6 * inputs[name].numel() * self._dense_params

    # -- clipping and the logged norm: ZeroAdamW's step does both -------------------------------
    def _clip_grad_norm(self, model: nn.Module) -> None:
        return None  # ZeroAdamW(max_grad_norm=...) clips in its step

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> None:
        return None  # known after the step: see _maybe_log_save_evaluate

    def _maybe_log_save_evaluate(
        self, tr_loss: torch.Tensor, grad_norm: Any, *args: Any, **kwargs: Any
    ) -> None:
        """The logged `grad_norm` is the last step's norm before clipping, `opt.grad_norm`."""
        if self.zero_optimizer is not None and self.state.global_step > 0:
            grad_norm = self.zero_optimizer.grad_norm.detach().clone()
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    # -- checkpoints --------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A folder `from_pretrained` loads. Collective: every rank joins the gathers (stage 3
        unit by unit), only the rank that writes keeps a copy of the params (See [Note:
        rank-0-only full state dict] in fusedzero/_model_state_dict.py)."""
        output_dir = self.args.output_dir if output_dir is None else output_dir
        # save_on_each_node: a writer on every node, each needing the params.
        rank0_only = not self.args.save_on_each_node
        state = full_state_dict(self.zero_optimizer, self.model, rank0_only=rank0_only)
        if self.args.should_save:
            self._save(output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Our sharded checkpoint in `output_dir/zero/` (every rank writes its shard), the
        scheduler as the Trainer saves it."""
        assert self.zero_optimizer is not None
        checkpoint.save(
            self.zero_optimizer, os.path.join(output_dir, ZERO_DIR), step=self.state.global_step
        )
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    def _load_optimizer_and_scheduler(self, resume_from: str | None) -> None:
        """Params, moments, step and hyper-parameters from `resume_from/zero/`, at any world
        size and stage; the Trainer restores the RNG states itself."""
        if resume_from is None:
            return
        assert self.zero_optimizer is not None
        zero_dir = os.path.join(resume_from, ZERO_DIR)
        if not os.path.isdir(zero_dir):
            raise FileNotFoundError(
                f"{resume_from} has no {ZERO_DIR}/ folder: it was not saved by ZeroTrainer (a "
                f"plain Trainer checkpoint holds a torch optimizer state); resume from a "
                f"ZeroTrainer checkpoint, or load its weights with from_pretrained and start anew"
            )
        checkpoint.load(self.zero_optimizer, zero_dir, restore_rng=False)
        sched = os.path.join(resume_from, _SCHEDULER)
        if os.path.isfile(sched):
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))


def _max_grad_norm(args: Any) -> float | None:
    """ZeroAdamW's clipping from TrainingArguments (the Trainer clips where it is > 0)."""
    return args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None


def _refuse_optimizers(kwargs: dict[str, Any]) -> None:
    opt, _ = kwargs.get("optimizers") or (None, None)
    if opt is not None and not isinstance(opt, ZeroAdamW | ZeroMuon):
        raise TypeError(
            f"ZeroTrainer got optimizers=({type(opt).__name__}, ...): it builds "
            f"ZeroAdamW from TrainingArguments; leave optimizers= out (or pass a "
            f"ZeroAdamW or ZeroMuon built with module=model, or muon= for Muon)"
        )
    if kwargs.get("optimizer_cls_and_kwargs") is not None:
        raise TypeError(
            "ZeroTrainer got optimizer_cls_and_kwargs=: it builds ZeroAdamW; pass "
            "ZeroAdamW keywords to ZeroTrainer itself (e.g. sharding=Sharding(...))"
        )


def _check_args(args: Any) -> None:
    """One line for each TrainingArguments setting ZeroTrainer cannot honour."""
    if args.deepspeed:
        raise ValueError(
            f"ZeroTrainer got TrainingArguments(deepspeed={args.deepspeed!r}): "
            f"ZeroAdamW shards the model itself; leave deepspeed= out (stage= is "
            f"ZeroTrainer's)"
        )
    if args.fsdp:
        raise ValueError(
            f"ZeroTrainer got TrainingArguments(fsdp={args.fsdp!r}): ZeroAdamW "
            f"shards the model itself; leave fsdp= out and pass stage=3 to "
            f"ZeroTrainer for sharded params"
        )
    if args.fp16:
        raise ValueError(
            "ZeroTrainer got TrainingArguments(fp16=True): the Trainer's grad scaler "
            "reads .grad, which ZeroAdamW keeps in its buffers; use bf16=True"
        )
    if args.bf16_full_eval or args.fp16_full_eval:
        flag = "bf16_full_eval" if args.bf16_full_eval else "fp16_full_eval"
        raise ValueError(
            f"ZeroTrainer got TrainingArguments({flag}=True): evaluate() would cast the "
            f"model with model.to(dtype=...), replacing the params' storage ZeroAdamW "
            f"owns; leave {flag} out (bf16=True autocasts evaluation too)"
        )
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in _TORCH_ADAMW:
        raise ValueError(
            f"ZeroTrainer got TrainingArguments(optim={optim!r}): it trains with "
            f"ZeroAdamW (fp32 AdamW, no 8-bit/paged/low-rank variant); use optim="
            f"{' or '.join(map(repr, sorted(_TORCH_ADAMW)))} (the default)"
        )
    if args.n_gpu > 1:
        raise ValueError(
            f"ZeroTrainer sees {args.n_gpu} GPUs in one process (the Trainer would "
            f"use nn.DataParallel): launch one process per GPU with torchrun"
        )
