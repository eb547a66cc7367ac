"""Watch a run: per-step metrics as JSON lines, a loss-curve PNG, a text sample of the model.

    log = MetricsLog("run/metrics.jsonl")            # rank 0; opened once, appended to
    log.write(12, loss=2.31, grad_norm=0.84, lr=3e-4, tokens_per_s=31e3, skipped=False, step_ms=9.6)
    plot_losses(read_jsonl("run/metrics.jsonl"), "run/loss.png", "fusedzero stage 2, W=2")
    print(sample_text(model, b"\\n", 200, temperature=0.8, top_k=40, seed=0))

matplotlib is an optional extra (`pip install 'fusedzero[plot]'`); nothing here imports it until
a plot is drawn, and `require_matplotlib()` lets a CLI refuse `--plot` before training starts.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusedzero import _safe_paths as safe_paths

# Every record has every key (null where unknown), so a reader gets one fixed schema. `run_id`
# tells the runs apart in a file that several runs appended to (a resume keeps its run's id).
FIELDS = (
    "run_id",
    "step",
    "loss",
    "val_loss",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "skipped",
    "step_ms",
)
PLOT_INSTALL_HINT = "pip install 'fusedzero[plot]'"
# The sample's temperature, besides 0 (greedy). Below 1e-3 the sample is the greedy one in all
# but name, and logits / T leaves fp32's range (1e-300 is 0 there: the softmax is NaN and the
# draw fails, after the whole run); above 1e3 it is uniform noise (past fp32's max T is inf,
# and a top-k-masked -inf / inf is NaN again).
TEMPERATURE_RANGE = (1e-3, 1e3)


def _json_value(v: Any) -> Any:
    # NaN/inf are not JSON (jq, JavaScript and pandas' strict readers reject them): write null.
    # A non-finite loss is still visible, as `skipped` and as a gap in the curve.
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _unwritable(flag: str, path: str | os.PathLike[str], e: OSError) -> ValueError:
    return ValueError(
        f"{flag} {str(path)!r}: cannot write there ({e.strerror or e}); "
        f"pass a file path in a writable folder"
    )


def check_writable(path: str | os.PathLike[str], flag: str) -> None:
    """Raise ValueError naming ``flag`` unless a file can be written at ``path``. Creates missing
    parent folders and nothing else, so a launcher can call it before training: a bad
    ``--log-jsonl`` or ``--plot`` path then fails in seconds, not after the run. A link or
    anything but a regular file there is refused (safe_paths.UnsafePath, a ValueError)."""
    p = Path(path)
    try:
        if p.is_dir():
            raise IsADirectoryError(21, "Is a directory")
        p.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p.parent):  # can a file be created beside it?
            pass
    except OSError as e:
        raise _unwritable(flag, path, e) from e
    safe_paths.check_output(p, flag)


def new_run_id() -> str:
    """A run's id: its start time (UTC, sortable) and 6 random hex digits."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


class MetricsLog:
    """Append-only JSON-lines file of per-step metrics, one object per line (keys: FIELDS).

    Opened once, for appending: records of earlier runs in the file stay, and every record
    carries ``run_id`` (a new one by default, or the resumed run's). Each line goes to the OS in
    one unbuffered write, so a killed run (SIGKILL, OOM killer) leaves only complete lines: the
    page cache outlives the process. A record holds a step's train metrics, its val loss, or
    both (null for the rest). On opening, a torn last line (a machine crash) is dropped, and
    with ``start_step > 0`` (a resume) so are this run's records for steps after it (written
    past the checkpoint the run resumes from), so the run reads as one uninterrupted run.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, run_id: str | None = None, start_step: int = 0
    ) -> None:
        self.path = Path(path)
        self.run_id = new_run_id() if run_id is None else run_id
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            safe_paths.check_output(self.path, "--log-jsonl")  # never read or write a link
            if self.path.exists():
                self._drop_stale(start_step)
            # Unbuffered: write() below is the write(2) system call itself.
            self._file = safe_paths.open_append(self.path, "--log-jsonl")
        except OSError as e:
            raise _unwritable("--log-jsonl", path, e) from e

    def _drop_stale(self, start_step: int) -> None:
        """Rewrite the log without a torn tail and without this run's records after
        ``start_step``, atomically (temp + rename); untouched when there is nothing to drop."""
        data = safe_paths.read_bytes(self.path, "--log-jsonl")
        try:
            records = read_jsonl(self.path)
        except ValueError as e:
            raise ValueError(
                f"--log-jsonl {str(self.path)!r} is not a metrics log to append to "
                f"({e}); pass a new file or an earlier run's log"
            ) from None
        # Records without a run id are from before ids were written: a resume counts them as its.
        keep = (
            records
            if start_step == 0
            else [
                r
                for r in records
                if r.get("run_id") not in (self.run_id, None) or r["step"] <= start_step
            ]
        )
        if len(keep) < len(records) or (data and not data.endswith(b"\n")):
            safe_paths.replace_file(
                self.path, lambda f: f.write(b"".join(self._line(r) for r in keep)), "--log-jsonl"
            )

    @staticmethod
    def _line(record: dict[str, Any]) -> bytes:
        clean = {k: _json_value(record.get(k)) for k in FIELDS}
        return (json.dumps(clean, allow_nan=False) + "\n").encode()

    def write(
        self,
        step: int,
        *,
        loss: float | None = None,
        val_loss: float | None = None,
        grad_norm: float | None = None,
        lr: float | None = None,
        tokens_per_s: float | None = None,
        skipped: bool | None = None,
        step_ms: float | None = None,
    ) -> None:
        """Append the record of ``step`` (None: not measured at this step, written as null)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        line = self._line(
            {
                "run_id": self.run_id,
                "step": step,
                "loss": loss,
                "val_loss": val_loss,
                "grad_norm": grad_norm,
                "lr": lr,
                "tokens_per_s": tokens_per_s,
                "skipped": None if skipped is None else bool(skipped),
                "step_ms": step_ms,
            }
        )
        view = memoryview(line)
        while view:  # a regular file takes it in one call; loop in case the OS returns short
            view = view[self._file.write(view) :]

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a metrics log, in file order. A last line without its newline is a write
    torn by a machine crash and is left out; any other line that is not a JSON object raises."""
    data = safe_paths.read_bytes(path, "metrics log")
    lines = data.split(b"\n")
    records = []
    # split() leaves "" after a final newline, or the torn tail: either way not a record.
    for n, raw in enumerate(lines[:-1], start=1):
        if not raw.strip():
            continue
        try:
            rec = safe_paths.parse_json(raw, f"{path}: line {n}")  # too deep: one line
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: line {n} is not JSON ({e.msg}): {raw[:80]!r}") from e
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            raise ValueError(
                f"{path}: line {n} is not a metrics record with an int 'step': {raw[:80]!r}"
            )
        records.append(rec)
    return records


def require_matplotlib() -> None:
    """Raise ImportError naming the extra to install when matplotlib is missing. Call it when
    `--plot` is parsed, so a run does not train for hours and then fail to draw."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"plotting the loss curve needs matplotlib, which is not installed: {PLOT_INSTALL_HINT}"
        ) from e


def plot_losses(records: list[dict[str, Any]], out_png: str | os.PathLike[str], title: str) -> None:
    """Draw train loss and val loss against step into ``out_png``.

    ``records`` are metrics records (``read_jsonl``); null losses (not measured, non-finite)
    are left out. The title should name the stage and world size, e.g. "fusedzero stage 2, W=2".
    """
    require_matplotlib()
    # The object API with the Agg canvas, not pyplot: no global figure state and no change to
    # the caller's backend (a notebook keeps its own).
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if not train and not val:
        raise ValueError(f"no loss in the {len(records)} records: nothing to plot to {out_png}")
    fig = Figure(figsize=(7, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", color="C0", linewidth=1.2)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="val loss", color="C1", linewidth=1.5)
    ax.set(xlabel="step", ylabel="loss (nats/byte)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    safe_paths.replace_file(out, lambda f: fig.savefig(f, format="png"), "--plot")


def check_temperature(temperature: float, name: str = "temperature") -> None:
    """Raise ValueError naming `name` unless `temperature` is 0 or in TEMPERATURE_RANGE."""
    lo, hi = TEMPERATURE_RANGE
    if not (temperature == 0.0 or lo <= temperature <= hi):
        raise ValueError(
            f"{name} must be 0 (greedy) or in [{lo:g}, {hi:g}] (below, the sample "
            f"is greedy in all but name and logits / T overflow fp32; above, it "
            f"is uniform noise), got {temperature:g}"
        )


@torch.no_grad()
def sample_text(
    model: nn.Module,
    prompt: bytes,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
) -> str:
    """Continue ``prompt`` with ``max_new_tokens`` bytes from a byte-level GPT (model.py).

    ``temperature == 0`` is greedy (argmax); ``> 0`` samples from softmax(logits / temperature)
    with a local ``torch.Generator`` seeded by ``seed``: repeatable, and the global RNG is left
    untouched; ``top_k > 0`` samples among the ``top_k`` likeliest bytes only. The context is
    cropped to the model's ``block_size``. Returns prompt plus continuation as `printable` text:
    decoded as UTF-8 in one piece at the end (a character whose bytes come from several steps
    stays whole), invalid bytes and control characters but newline and tab as U+FFFD. The
    model runs in eval mode and is put back in its own mode.
    ZeRO-3: every rank must call this with the same arguments (each forward gathers params
    collectively); all ranks then get the same text.
    """
    if not prompt:
        raise ValueError("prompt is empty: the model needs at least one byte, e.g. b'\\n'")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    check_temperature(temperature)
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: every byte), got {top_k}")
    block_size: int = model.config.block_size
    device = next(iter(model.parameters())).device
    gen = torch.Generator(device=device).manual_seed(seed)
    idx = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            logits, _ = model(idx[:, -block_size:])
            # Only byte ids can be decoded: a vocabulary padded past 256 never samples the pad.
            last = logits[:, -1, :256].float()
            if temperature == 0.0:
                nxt = last.argmax(dim=-1, keepdim=True)
            else:
                if 0 < top_k < last.shape[-1]:
                    kth = torch.topk(last, top_k, dim=-1).values[:, -1:]
                    last = last.masked_fill(last < kth, -math.inf)
                probs = torch.softmax(last / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=gen)
            idx = torch.cat([idx, nxt], dim=1)
    finally:
        model.train(was_training)
    return printable(bytes(idx[0].tolist()))


# C0 controls and DEL but newline and tab, and the C1 controls: a model that emits ESC or CR
# would move the cursor or redraw the caller's terminal.
_CONTROLS = {c: "\ufffd" for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)] if c not in (9, 10)}


def printable(data: bytes) -> str:
    """``data`` as text safe to print: decoded as UTF-8 in one piece (never byte by byte, which
    would tear every multi-byte character), invalid bytes and control characters other than
    newline and tab replaced by U+FFFD."""
    return data.decode("utf-8", errors="replace").translate(_CONTROLS)
