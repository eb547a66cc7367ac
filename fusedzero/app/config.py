"""`fusedzero train`'s configuration: the flags, parsed once into a validated TrainConfig.

Errors in flags are UsageError (one line, `fusedzero: error: ...`, exit 2); a rank that waited
past --timeout ends the run with StalledError (exit 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

import torch

from fusedzero import _dtypes as dtypes
from fusedzero._comm import DEFAULT_TIMEOUT_S
from fusedzero.app.model import PRESETS, GPTConfig
from fusedzero.app.tp_plan import check_tp
from fusedzero.app.watch import check_temperature
from fusedzero.memory_modes import MASTER_MODES, STATE_MODES
from fusedzero.policy import Precision, Sharding, Wire
from fusedzero.wire import WIRES

# Defaults for the 2-rank CPU run: measured 77 s wall on an idle 2-core machine including
# start-up (~30k tokens/s; 104 s with other jobs on the cores), validation loss 5.33 -> 1.90.
DEFAULT_STEPS = 500
DEFAULT_BATCH = 32
DEFAULT_LR = 3e-3
# --optimizer muon: the peak lr of the Muon groups (the hidden matrices; torch.optim.Muon's
# "original" lr adjustment, sqrt(max(1, rows / cols))): the best of 0.02, 0.05 and 0.1 on the
# default model and corpus over the default 500 steps (docs/benchmarks.md, "Muon"; also the best
# of 0.01-0.05 over 200 steps). The embeddings, head, norms and biases keep AdamW at --lr.
DEFAULT_MUON_LR = 0.05
OPTIMIZERS = ("adamw", "muon")
DEFAULT_N_LAYER = 2
DEFAULT_N_HEAD = 4
DEFAULT_N_EMBD = 128
DEFAULT_BLOCK = 128
# Validation sequences evaluated at every eval; fixed windows spread over the val split.
DEFAULT_EVAL_SEQS = 64
# Log points read device values back to the host (a sync on CUDA): not every step.
DEFAULT_LOG_EVERY = 10
# The end-of-run sample: softmax(logits / 0.8) over the 40 likeliest bytes, nanoGPT's defaults
# for its sample.py (greedy decoding of a small byte model repeats its likeliest byte, a space).
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 40
# --timeout's range in seconds. Below 1 s the ranks' own start-up (a TCP connect, gloo's
# handshake) times out ("timed out after 0ms" at 0.0004); above 1e9 s (31 years: no limit in
# practice) the process group's timeout, milliseconds held as int64 nanoseconds in C++,
# overflows (1e10: C++ frames; 1e30: OverflowError).
TIMEOUT_MIN_S, TIMEOUT_MAX_S = 1.0, 1e9
# --lr and --weight-decay are used in fp32 (the kernel's arithmetic, ZeroAdamW's checks): an lr
# under fp32's smallest normal number is subnormal or 0 there (1e-46 is 0: the run trains
# nothing), over its max inf (1e39: the ranks refuse it after start-up).
FP32 = torch.finfo(torch.float32)
# --seed: data order (BatchSampler seeds a generator with seed * 1_000_003 + step, which must fit
# 64 bits), model init and bf16-sr's stream; the range numpy and most tools take.
SEED_MAX = 2**32 - 1
# Fraction of the corpus (its tail) held out for validation.
VAL_FRACTION = 0.05
# The cosine decays to this fraction of --lr (as in nanoGPT / Chinchilla-style schedules).
MIN_LR_RATIO = 0.1


class UsageError(Exception):
    """A bad flag, path or checkpoint: reported as one line, `fusedzero: error: ...`, exit 2."""


class StalledError(RuntimeError):
    """A rank waited on the others past --timeout: one line naming each rank and its wait
    (`fusedzero: error: ...`, exit 1)."""


class ArgParser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing usage and exiting (the CLI prints it
    as one line; the python API lets the caller catch it)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        # "fusedzero train: argument --stage: ..." -> "train: argument --stage: ..."
        where = self.prog.split(" ", 1)[1] + ": " if " " in self.prog else ""
        raise UsageError(f"{where}{message}")


# -- configuration --------------------------------------------------------------------------------
@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """One training run. Built from the command line by `parse_args`, validated here."""

    stage: int = 2
    """ZeRO stage: 0 DP, 1 optimizer state, 2 + grads, 3 + params."""
    nproc: int | None = None
    """Local ranks to spawn (None: every GPU, or 2 on CPU). Ignored under torchrun."""
    steps: int = DEFAULT_STEPS
    """Optimizer steps of the whole run; the lr schedule spans them (also with --stop-at)."""
    batch_size: int = DEFAULT_BATCH
    """Global batch in sequences per step, over all ranks and micro-batches."""
    grad_accum: int = 1
    """Micro-batches per step on each rank."""
    lr: float = DEFAULT_LR
    """Peak learning rate (after warmup); with --optimizer muon, of the AdamW groups."""
    optimizer: str = "adamw"
    """adamw: ZeroAdamW on every param. muon: ZeroMuon, Muon on the hidden matrices (at
    --muon-lr) and AdamW on the embeddings, head, norms and biases (docs/muon.md)."""
    muon_lr: float = DEFAULT_MUON_LR
    """Peak learning rate of the Muon groups (--optimizer muon); same schedule as --lr."""
    warmup: int | None = None
    """Linear warmup steps (None: 5% of --steps, at least 1)."""
    weight_decay: float = 0.1
    """Decoupled weight decay of matrices and embeddings (1-D params get none)."""
    beta1: float = 0.9
    """Adam's first-moment decay."""
    beta2: float = 0.95
    """Adam's second-moment decay (0.95, as is usual for transformer pretraining)."""
    clip: float = 1.0
    """Max global grad norm; 0 disables clipping."""
    seed: int = 0
    """Model init and data order."""
    preset: str | None = None
    """A named model shape (fusedzero.app.model.PRESETS: gpt2 ... gpt2-xl, llama-254m); the
    shape flags given beside it override its values."""
    n_layer: int = DEFAULT_N_LAYER
    """Transformer blocks."""
    n_head: int = DEFAULT_N_HEAD
    """Attention heads; must divide n_embd."""
    n_embd: int = DEFAULT_N_EMBD
    """Width of the residual stream."""
    block_size: int = DEFAULT_BLOCK
    """Sequence length in bytes."""
    data: str | None = None
    """Text file or folder; None: the Python standard library's sources."""
    eval_every: int = 100
    """Steps between validation evals (0: only at the start and the end)."""
    eval_seqs: int = DEFAULT_EVAL_SEQS
    """Validation sequences per eval."""
    log_every: int = DEFAULT_LOG_EVERY
    """Steps between log points (host reads of loss / grad norm)."""
    ckpt_dir: str | None = None
    """Checkpoint root (one folder per saved step, written by fusedzero.checkpoint)."""
    save_every: int = 0
    """Steps between checkpoints (0: only at --stop-at and the end)."""
    keep_last: int | None = None
    """Checkpoints to keep in --ckpt-dir (None: all)."""
    resume: bool = False
    """Resume from the latest complete checkpoint in --ckpt-dir (any world size or stage)."""
    overwrite: bool = False
    """Start a new run in a --ckpt-dir that holds checkpoints; they are removed after this
    run's first complete save (without it, such a folder is refused)."""
    timeout: float = DEFAULT_TIMEOUT_S
    """Seconds any rank may wait on the others (a collective, a checkpoint write) before the run
    ends with an error naming the rank and what it waited for."""
    stop_at: int | None = None
    """Stop cleanly after this step and save, as a preempted job would."""
    out_json: str | None = None
    """Write the summary (per-step losses, bytes, dtypes) here as JSON, from rank 0."""
    bucket_numel: int | None = None
    """Elements per bucket (None: the library default)."""
    reduce_dtype: str = "fp32"
    """fp32 / bf16 / fp16: dtype grads are reduced and accumulated in."""
    param_dtype: str | None = None
    """fp32 / bf16 / fp16 (None: bf16 on CUDA, fp32 on CPU)."""
    wire: str | None = None
    """fp32 / bf16 / int8: what grads cross the network as, summed in fp32 (Wire(grads=);
    None: a reduce-scatter in --reduce-dtype). docs/wire.md."""
    param_wire: str | None = None
    """fp32 / bf16 / int8: what the param all-gathers send (None: the param dtype)."""
    master: str = "fp32"
    """Master weights (Precision(master=)): fp32, or with --param-dtype bf16 no fp32 master:
    bf16-kahan, bf16-sr or bf16 (fusedzero/memory_modes.py)."""
    states: str = "fp32"
    """The update rule's state storage (Precision(states=)): fp32, bf16 or int8."""
    device: str = "auto"
    """auto (CUDA if available), cpu or cuda."""
    progress: bool = True
    """A tqdm bar on rank 0."""
    log_jsonl: str | None = None
    """Append per-step metrics (run id, loss, val loss, grad norm, lr, tokens/s, skipped, step
    ms) to this file as JSON lines, from rank 0, at every log point, after a step-0 val record;
    a resume appends under its run's id (fusedzero/app/watch.py)."""
    plot: str | None = None
    """At the end, draw train and val loss against step into this PNG (needs matplotlib)."""
    sample_tokens: int = 200
    """At the end, print this many bytes generated by the trained model (0: none)."""
    temperature: float = DEFAULT_TEMPERATURE
    """Sampling temperature of the end-of-run sample (0: greedy, which a byte-level model
    trained for minutes turns into a run of spaces)."""
    top_k: int = DEFAULT_TOP_K
    """Sample only among the k most likely bytes (0: all 256)."""
    tp: int = 1
    """Tensor-parallel ranks per model replica (fusedzero/app/tp_plan.py); ZeroAdamW shards
    over the remaining nproc / tp data-parallel ranks."""

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise UsageError(msg)

        need(self.stage in (0, 1, 2, 3), f"--stage must be 0, 1, 2 or 3, got {self.stage}")
        for name in (
            "steps",
            "batch_size",
            "grad_accum",
            "n_layer",
            "n_head",
            "n_embd",
            "block_size",
            "eval_seqs",
            "log_every",
        ):
            v = getattr(self, name)
            need(v >= 1, f"--{name.replace('_', '-')} must be >= 1, got {v}")
        need(self.nproc is None or self.nproc >= 1, f"--nproc must be >= 1, got {self.nproc}")
        need(
            self.n_embd % self.n_head == 0,
            f"--n-embd {self.n_embd} is not divisible by --n-head {self.n_head}",
        )
        need(
            FP32.tiny <= self.lr <= FP32.max,
            f"--lr must be in [{FP32.tiny:.4g}, {FP32.max:.4g}], a normal fp32 number (the "
            "update is computed in fp32, where a smaller lr is 0 or subnormal and trains "
            f"nothing, a larger one inf), got {self.lr:g}",
        )
        need(
            self.optimizer in OPTIMIZERS,
            f"--optimizer must be one of {list(OPTIMIZERS)}, got {self.optimizer!r}",
        )
        need(
            FP32.tiny <= self.muon_lr <= FP32.max,
            f"--muon-lr must be in [{FP32.tiny:.4g}, {FP32.max:.4g}], a normal fp32 number, "
            f"got {self.muon_lr:g}",
        )
        if self.optimizer == "muon":
            self._check_muon()
        need(
            self.clip >= 0 and (self.clip <= FP32.max or self.clip == math.inf),
            f"--clip must be >= 0 (0 disables) and within fp32's range, got {self.clip:g}",
        )
        need(
            0 <= self.weight_decay <= FP32.max,
            f"--weight-decay must be in [0, {FP32.max:.4g}] (finite in fp32, the kernel's "
            f"arithmetic), got {self.weight_decay:g}",
        )
        need(
            0 <= self.seed <= SEED_MAX,
            f"--seed must be in [0, {SEED_MAX}] (2**32 - 1), got {self.seed}",
        )
        need(
            0 <= self.beta1 < 1 and 0 <= self.beta2 < 1,
            f"--beta1/--beta2 must be in [0, 1), got {self.beta1}, {self.beta2}",
        )
        need(
            self.warmup is None or 0 <= self.warmup <= self.steps,
            f"--warmup must be in [0, --steps={self.steps}], got {self.warmup}",
        )
        need(self.eval_every >= 0, f"--eval-every must be >= 0, got {self.eval_every}")
        need(self.save_every >= 0, f"--save-every must be >= 0, got {self.save_every}")
        need(
            self.keep_last is None or self.keep_last >= 1,
            f"--keep-last must be >= 1, got {self.keep_last}",
        )
        need(
            self.bucket_numel is None or self.bucket_numel >= 1,
            f"--bucket-numel must be >= 1, got {self.bucket_numel}",
        )
        names = sorted(dtypes.SHORT_NAMES)
        need(
            self.reduce_dtype in names,
            f"--reduce-dtype must be one of {names}, got {self.reduce_dtype!r}",
        )
        need(
            self.param_dtype is None or self.param_dtype in names,
            f"--param-dtype must be one of {names}, got {self.param_dtype!r}",
        )
        for flag, v in (("--wire", self.wire), ("--param-wire", self.param_wire)):
            need(v is None or v in WIRES, f"{flag} must be one of {list(WIRES)}, got {v!r}")
        need(
            self.master in MASTER_MODES,
            f"--master must be one of {list(MASTER_MODES)}, got {self.master!r}",
        )
        need(
            self.states in STATE_MODES,
            f"--states must be one of {list(STATE_MODES)}, got {self.states!r}",
        )
        need(
            self.master == "fp32" or self.param_dtype == "bf16",
            f"--master {self.master} keeps no fp32 master (the bf16 params are the master): "
            f"it needs --param-dtype bf16, got {self.param_dtype or 'the device default'}",
        )
        need(
            self.sample_tokens >= 0,
            f"--sample-tokens must be >= 0 (0 disables), got {self.sample_tokens}",
        )
        try:  # checked now, not when the sample is drawn after the whole run
            check_temperature(self.temperature, "--temperature")
        except ValueError as e:
            raise UsageError(str(e)) from None
        need(self.top_k >= 0, f"--top-k must be >= 0 (0: all bytes), got {self.top_k}")
        need(
            TIMEOUT_MIN_S <= self.timeout <= TIMEOUT_MAX_S,
            f"--timeout must be in [{TIMEOUT_MIN_S:g}, {TIMEOUT_MAX_S:g}] seconds (less: the "
            f"ranks' start-up alone times out; {TIMEOUT_MAX_S:g} s is 31 years, no limit in "
            f"practice), got {self.timeout:g}",
        )
        need(
            not (self.resume and self.overwrite),
            "--resume and --overwrite exclude each other: continue the run in --ckpt-dir, or "
            "start over in it",
        )
        need(
            self.preset is None or self.preset in PRESETS,
            f"--preset must be one of {sorted(PRESETS)}, got {self.preset!r}",
        )
        need(
            self.device in ("auto", "cpu", "cuda"),
            f"--device must be auto, cpu or cuda, got {self.device!r}",
        )
        tp_problem = check_tp(self.tp, self.n_head, self.n_embd)
        need(tp_problem is None, tp_problem or "")
        if self.tp > 1:  # fusedzero/app/tp_plan.py splits q, k, v in equal thirds and fc whole
            mc = self.model_config()
            need(
                mc.get("n_kv_head") in (None, mc["n_head"]) and mc.get("mlp", "gelu") == "gelu",
                f"--tp {self.tp} with --preset {self.preset}: the tensor-parallel plan covers "
                "multi-head attention with a GELU MLP (no grouped kv heads, no SwiGLU); use "
                "--tp 1 or a gpt2 preset",
            )
        if self.preset is not None:  # the preset's fields beside the given shape flags
            try:
                GPTConfig(**self.model_config())
            except ValueError as e:
                raise UsageError(f"--preset {self.preset} with these shape flags: {e}") from None
        if self.stop_at is not None:
            need(
                1 <= self.stop_at <= self.steps,
                f"--stop-at must be in [1, --steps={self.steps}], got {self.stop_at}",
            )
        for flag, used in (
            ("--resume", self.resume),
            ("--overwrite", self.overwrite),
            ("--save-every", self.save_every > 0),
            ("--stop-at", self.stop_at is not None),
            ("--keep-last", self.keep_last is not None),
        ):
            need(
                not used or self.ckpt_dir is not None,
                f"{flag} needs --ckpt-dir DIR (where checkpoints are written and read)",
            )

    def _check_muon(self) -> None:
        """What ZeroMuon cannot run yet, refused before any rank starts."""
        if self.master != "fp32":
            raise UsageError(
                f"--optimizer muon with --master {self.master}: Muon updates an fp32 master; "
                "use --master fp32"
            )
        if self.states == "int8":
            raise UsageError(
                "--optimizer muon with --states int8: Muon keeps its momentum in fp32 or bf16; "
                "use --states fp32 or --states bf16"
            )
        if self.tp > 1:
            raise UsageError(
                f"--optimizer muon with --tp {self.tp}: Newton-Schulz needs each matrix whole "
                "and tensor parallelism splits them; use --tp 1"
            )

    @property
    def warmup_steps(self) -> int:
        return max(1, self.steps // 20) if self.warmup is None else self.warmup

    def params_dtype(self, cuda: bool) -> Any:
        """The model params' dtype: --param-dtype, else bf16 on GPUs (fp32 master) and fp32 on
        the CPU (whose GEMMs have no fast bf16)."""
        if self.param_dtype:
            return dtypes.SHORT_NAMES[self.param_dtype]
        return dtypes.SHORT_NAMES["bf16" if cuda else "fp32"]

    def precision(self, cuda: bool) -> Precision:
        """ZeroAdamW's `Precision` from --param-dtype (see `params_dtype`), --reduce-dtype,
        --master, --states and --seed (the stream of --master bf16-sr)."""
        return Precision(
            param_dtype=self.params_dtype(cuda),
            reduce_dtype=dtypes.SHORT_NAMES[self.reduce_dtype],
            master=self.master,
            states=self.states,  # type: ignore[arg-type]
            seed=self.seed,
        )

    def wire_policy(self) -> Wire:
        """ZeroAdamW's `Wire` from --wire and --param-wire."""
        return Wire(grads=self.wire, params=self.param_wire)  # type: ignore[arg-type]

    def sharding(self) -> Sharding:
        """ZeroAdamW's `Sharding` from --bucket-numel (units: the GPT's blocks, the default)."""
        return Sharding(bucket_numel=self.bucket_numel)

    def model_config(self) -> dict[str, Any]:
        """GPTConfig fields: the preset's (if any) under the four shape flags."""
        extra = {k: v for k, v in PRESETS[self.preset].items()} if self.preset else {}
        return {
            **extra,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_embd": self.n_embd,
            "block_size": self.block_size,
        }


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig  # defaults live on the dataclass
    a = p.add_argument
    a(
        "--stage",
        type=int,
        choices=(0, 1, 2, 3),
        default=d.stage,
        help="ZeRO stage: 0 DP, 1 optimizer state, 2 +grads, 3 +params (default %(default)s)",
    )
    a(
        "--nproc",
        type=int,
        default=None,
        help="local ranks to spawn (default: every GPU, or 2 on CPU); ignored under torchrun",
    )
    a("--steps", type=int, default=d.steps, help="optimizer steps (default %(default)s)")
    a(
        "--batch-size",
        type=int,
        default=d.batch_size,
        help="global batch in sequences per step (default %(default)s)",
    )
    a("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per step per rank")
    a("--lr", type=float, default=d.lr, help="peak learning rate (default %(default)s)")
    a(
        "--optimizer",
        choices=OPTIMIZERS,
        default=d.optimizer,
        help="adamw: ZeroAdamW on every param; muon: ZeroMuon, Muon on the hidden matrices at "
        "--muon-lr, AdamW at --lr on the rest (default %(default)s)",
    )
    a(
        "--muon-lr",
        type=float,
        default=d.muon_lr,
        help="peak lr of the Muon groups with --optimizer muon (default %(default)s)",
    )
    a("--warmup", type=int, default=None, help="linear warmup steps (default 5%% of --steps)")
    a(
        "--weight-decay",
        type=float,
        default=d.weight_decay,
        help="AdamW decoupled weight decay of matrices",
    )
    a("--beta1", type=float, default=d.beta1, help="AdamW beta1")
    a("--beta2", type=float, default=d.beta2, help="AdamW beta2")
    a("--clip", type=float, default=d.clip, help="max grad norm, 0 disables (default %(default)s)")
    a("--seed", type=int, default=d.seed, help="model init and data order")
    a(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="a named model shape (GPT-2 sizes as `fusedzero plan --preset`, or llama-254m: "
        "GQA, SwiGLU, untied head); --n-layer/--n-head/--n-embd/--block-size override it",
    )
    # Shape flags default to None here: config_from_args tells a given flag from the preset's.
    a("--n-layer", type=int, default=None, help=f"transformer blocks (default {d.n_layer})")
    a("--n-head", type=int, default=None, help=f"attention heads (default {d.n_head})")
    a("--n-embd", type=int, default=None, help=f"model width (default {d.n_embd})")
    a(
        "--block-size",
        type=int,
        default=None,
        help=f"sequence length in bytes (default {d.block_size})",
    )
    a(
        "--data",
        default=None,
        metavar="PATH",
        help="text file or folder (default: the Python standard library's sources)",
    )
    a(
        "--eval-every",
        type=int,
        default=d.eval_every,
        help="steps between validation evals, 0: start and end only (default %(default)s)",
    )
    a("--eval-seqs", type=int, default=d.eval_seqs, help="validation sequences per eval")
    a("--log-every", type=int, default=d.log_every, help="steps between log points")
    a("--ckpt-dir", default=None, metavar="DIR", help="checkpoint folder")
    a(
        "--save-every",
        type=int,
        default=d.save_every,
        help="steps between checkpoints (0: at --stop-at and the end only)",
    )
    a("--keep-last", type=int, default=None, help="checkpoints to keep (default all)")
    a(
        "--resume",
        action="store_true",
        help="resume from the latest complete checkpoint in --ckpt-dir (any world size/stage); "
        "hyper-parameter flags given now (--lr, --beta1, --beta2, --weight-decay, --clip, "
        "--warmup) override the checkpoint's",
    )
    a(
        "--overwrite",
        action="store_true",
        help="start a new run in a --ckpt-dir that holds checkpoints (removed after this run's "
        "first save); without it or --resume such a folder is refused",
    )
    a(
        "--stop-at",
        type=int,
        default=None,
        metavar="STEP",
        help="stop after STEP and save, as if preempted (the schedule still spans --steps)",
    )
    a("--out-json", default=None, metavar="FILE", help="write the run summary as JSON")
    a(
        "--timeout",
        type=float,
        default=d.timeout,
        metavar="SECONDS",
        help="end the run with an error naming the rank and the operation when any rank waits "
        f"on the others longer than this, {TIMEOUT_MIN_S:g} to {TIMEOUT_MAX_S:g} "
        "(default %(default)g = 10 minutes)",
    )
    a("--bucket-numel", type=int, default=None, help="elements per bucket")
    a(
        "--reduce-dtype",
        choices=sorted(dtypes.SHORT_NAMES),
        default="fp32",
        help="dtype grads are reduced in (default %(default)s)",
    )
    a(
        "--param-dtype",
        choices=sorted(dtypes.SHORT_NAMES),
        default=None,
        help="model param dtype (default bf16 on CUDA, fp32 on CPU)",
    )
    a(
        "--wire",
        choices=WIRES,
        default=None,
        help="what grads cross the network as, summed in fp32 on arrival: fp32, bf16 or int8 "
        "(block-wise absmax, one fp32 scale per 128); default: a reduce-scatter in "
        "--reduce-dtype (docs/wire.md)",
    )
    a(
        "--param-wire",
        choices=WIRES,
        default=None,
        help="what the param all-gathers send: fp32, bf16 or int8 (default: the param dtype)",
    )
    a(
        "--master",
        choices=MASTER_MODES,
        default=d.master,
        help="master weights: fp32, or (with --param-dtype bf16) bf16-kahan, bf16-sr, bf16",
    )
    a(
        "--states",
        choices=STATE_MODES,
        default=d.states,
        help="Adam moments stored as fp32, bf16 or int8 (blockwise, one scale per 128)",
    )
    a(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: CUDA with NCCL when a GPU is visible, else CPU with gloo",
    )
    a("--no-progress", dest="progress", action="store_false", help="no progress bar")
    a(
        "--log-jsonl",
        default=None,
        metavar="FILE",
        help="append per-step metrics as JSON lines (run_id, step, loss, val_loss, grad_norm, "
        "lr, tokens_per_s, skipped, step_ms) at every log point, after a step-0 val record; "
        "earlier runs' lines stay, a --resume continues its run's run_id",
    )
    a(
        "--plot",
        default=None,
        metavar="PNG",
        help="draw the loss curves (train and val against step) at the end; needs "
        "pip install 'fusedzero[plot]'",
    )
    a(
        "--sample-tokens",
        type=int,
        default=d.sample_tokens,
        metavar="N",
        help="print N bytes sampled from the trained model at the end, 0: none "
        "(default %(default)s)",
    )
    a(
        "--temperature",
        type=float,
        default=d.temperature,
        metavar="T",
        help="sampling temperature of that sample, 0: greedy (default %(default)s)",
    )
    a(
        "--top-k",
        type=int,
        default=d.top_k,
        metavar="K",
        help="sample among the K likeliest bytes, 0: all (default %(default)s)",
    )
    a(
        "--tp",
        type=int,
        default=d.tp,
        metavar="N",
        help="tensor-parallel ranks per replica: attention and MLP split over N ranks, ZeroAdamW "
        "shards over nproc/N (default %(default)s)",
    )


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless its help already says it or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        # A switch (store_true/store_false, nargs 0) has no value to show: its default is the
        # state without the flag, which its help already describes ("--no-progress (default:
        # True)" read as if the flag were on by default).
        if (
            "default" in text
            or action.nargs == 0
            or any(action.default is v for v in (None, False, argparse.SUPPRESS))
        ):
            return text
        return super()._get_help_string(action) or ""


_SHAPE = ("n_layer", "n_head", "n_embd", "block_size")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    kw = {k: v for k, v in vars(args).items() if k in fields}
    preset = PRESETS.get(kw.get("preset") or "", {})
    for k in _SHAPE:  # a shape flag not given: the preset's value, else the default
        if kw.get(k) is None:
            kw.pop(k, None)
            if k in preset:
                kw[k] = preset[k]
    return TrainConfig(**kw)


def parse_args(argv: list[str]) -> TrainConfig:
    p = ArgParser(prog="fusedzero train")
    add_arguments(p)
    return config_from_args(p.parse_args(argv))
