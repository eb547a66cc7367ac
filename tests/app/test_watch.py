"""fusedzero.watch: the metrics log, the loss-curve PNG and the text sample, on tiny inputs."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fusedzero.app.model import GPT, GPTConfig
from fusedzero.app.watch import (
    FIELDS,
    MetricsLog,
    check_writable,
    plot_losses,
    printable,
    read_jsonl,
    sample_text,
)

REPO = Path(__file__).resolve().parents[2]


def _records(n: int, val_every: int, seed: int = 0) -> list[dict]:
    """A noisy decreasing loss curve with a val loss every `val_every` steps (and at step 0)."""
    rng = random.Random(seed)
    recs = [{"step": 0, "val_loss": 5.5 + rng.random()}]
    for s in range(1, n + 1):
        recs.append(
            {
                "step": s,
                "loss": 5.5 * 0.98**s + 0.3 * rng.random(),
                "grad_norm": rng.uniform(0.1, 3.0),
                "lr": 3e-4 * rng.random(),
                "tokens_per_s": rng.uniform(1e4, 5e4),
                "skipped": rng.random() < 0.1,
                "step_ms": rng.uniform(5, 50),
                "val_loss": 5.0 * 0.98**s + 0.1 * rng.random() if s % val_every == 0 else None,
            }
        )
    return recs


def _write_all(log: MetricsLog, recs: list[dict]) -> None:
    for r in recs:
        log.write(r["step"], **{k: v for k, v in r.items() if k != "step"})


def _full(r: dict, run_id: str) -> dict:
    return {k: r.get(k) for k in FIELDS} | {"run_id": run_id}


# -- MetricsLog ----------------------------------------------------------------------------------
def test_metrics_log_round_trip_one_complete_line_per_write(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "m.jsonl"  # a missing parent folder is created
    recs = _records(9, val_every=4)
    with MetricsLog(path, run_id="run-a") as log:
        for i, r in enumerate(recs):
            _write_all(log, [r])
            # Flushed per line: the file holds every record so far while the log is still open.
            text = path.read_text()
            assert text.endswith("\n") and text.count("\n") == i + 1
    lines = path.read_text().splitlines()
    for line in lines:
        obj = json.loads(line)
        assert list(obj) == list(FIELDS), obj  # one fixed schema, absent values as null
    got = read_jsonl(path)
    assert got == [_full(r, "run-a") for r in recs]
    assert got[0]["loss"] is None and got[4]["val_loss"] is not None and got[5]["val_loss"] is None
    assert all(isinstance(r["skipped"], bool) for r in got[1:])


def test_metrics_log_appends_and_tells_runs_apart(tmp_path: Path) -> None:
    """A second run into the same file appends (the help says so) under its own run id; a
    default id is new per log."""
    path = tmp_path / "m.jsonl"
    recs = _records(3, val_every=2)
    with MetricsLog(path) as first:
        _write_all(first, recs)
    with MetricsLog(path) as second:
        second.write(0, val_loss=5.0)
    assert first.run_id != second.run_id and first.run_id[:4].isdigit()
    got = read_jsonl(path)
    assert got == [_full(r, first.run_id) for r in recs] + [
        _full({"step": 0, "val_loss": 5.0}, second.run_id)
    ]


def test_metrics_log_non_finite_values_are_strict_json_null(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    with MetricsLog(path) as log:
        log.write(1, loss=float("nan"), grad_norm=float("inf"), lr=1e-3, skipped=True)

    def no_constants(name: str) -> None:
        raise AssertionError(f"non-standard JSON constant {name} in the log")

    obj = json.loads(path.read_text(), parse_constant=no_constants)
    assert obj["loss"] is None and obj["grad_norm"] is None and obj["lr"] == 1e-3
    assert obj["skipped"] is True


@pytest.mark.slow
def test_metrics_log_killed_run_leaves_complete_lines(tmp_path: Path) -> None:
    """SIGKILL right after the writes (no close, no atexit): every line is there and whole."""
    path = tmp_path / "m.jsonl"
    code = textwrap.dedent(f"""
        import os, signal
        from fusedzero.app.watch import MetricsLog
        log = MetricsLog({str(path)!r})
        for s in range(1, 51):
            log.write(s, loss=1.0 / s, grad_norm=0.5, lr=1e-3, tokens_per_s=1e4,
                      skipped=False, step_ms=2.5)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    assert path.read_bytes().endswith(b"\n")
    got = read_jsonl(path)
    assert [r["step"] for r in got] == list(range(1, 51))
    assert got[9]["loss"] == 1.0 / 10


def test_metrics_log_resume_drops_later_steps_and_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    recs = _records(8, val_every=3)
    with MetricsLog(path, run_id="other") as log:  # an earlier run in the same file
        _write_all(log, recs)
    with MetricsLog(path, run_id="this") as log:
        _write_all(log, recs)
    with path.open("ab") as f:
        f.write(b'{"step": 9, "loss": 1.2')  # a write torn by a machine crash
    assert [r["step"] for r in read_jsonl(path)] == 2 * list(range(9))  # the torn tail ignored

    # This run resumed from a checkpoint at step 5: its steps 6-8 will be run again, so their
    # lines go; the other run's stay.
    with MetricsLog(path, run_id="this", start_step=5) as log:
        log.write(6, loss=0.25, val_loss=0.5)
    got = read_jsonl(path)
    assert got[:9] == [_full(r, "other") for r in recs]
    assert got[9:15] == [_full(r, "this") for r in recs[:6]]
    assert [r["step"] for r in got[9:]] == list(range(7)) and got[15]["loss"] == 0.25


def test_metrics_log_refuses_to_append_to_a_file_that_is_no_log(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("my notes\n")
    with pytest.raises(
        ValueError,
        match=r"--log-jsonl .*notes.txt' is not a metrics log to "
        r"append to \(.*line 1 is not JSON",
    ):
        MetricsLog(path)
    assert path.read_text() == "my notes\n"


def test_read_jsonl_names_a_corrupt_line(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"line 2 is not JSON"):
        read_jsonl(path)
    path.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"line 2 is not a metrics record"):
        read_jsonl(path)


def test_metrics_log_refuses_unwritable_path_and_bad_step(tmp_path: Path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    # The tests may run as root, which ignores permission bits: use paths no user can write.
    for bad in (tmp_path, a_file / "m.jsonl"):  # a folder; a "folder" that is a file
        with pytest.raises(
            ValueError,
            match=r"--log-jsonl .*(cannot write there.*writable "
            r"folder|is a folder.*pass a file path)",
        ):
            MetricsLog(bad)
        assert str(bad) in str(pytest.raises(ValueError, MetricsLog, bad).value)
        for flag in ("--log-jsonl", "--plot"):  # the launcher's check, before training
            with pytest.raises(ValueError, match=rf"{flag} .*cannot write there"):
                check_writable(bad, flag)
    good = tmp_path / "new" / "m.jsonl"
    check_writable(good, "--log-jsonl")
    assert good.parent.is_dir() and not list(good.parent.iterdir()), "the check left a file"
    with MetricsLog(tmp_path / "m.jsonl") as log:
        for step in (-1, 1.0, True):
            with pytest.raises(ValueError, match=r"step must be an int >= 0"):
                log.write(step, loss=1.0)  # type: ignore[arg-type]


# -- plot_losses ---------------------------------------------------------------------------------
def _near(img: torch.Tensor, rgb: tuple[int, int, int], tol: float = 0.08) -> int:
    """Pixels within `tol` of a colour (img: H x W x 3 floats in [0, 1])."""
    target = torch.tensor(rgb, dtype=torch.float32) / 255
    return int(((img - target).abs().amax(dim=-1) < tol).sum())


def test_plot_losses_writes_a_png_with_both_curves(tmp_path: Path) -> None:
    mpimg = pytest.importorskip("matplotlib.image")  # a dev dependency: present in CI
    path = tmp_path / "m.jsonl"
    with MetricsLog(path) as log:
        _write_all(log, _records(60, val_every=10))
    out = tmp_path / "plots" / "loss.png"
    plot_losses(read_jsonl(path), out, "fusedzero stage 2, W=2")

    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    assert 5_000 < len(data) < 2_000_000, len(data)
    img = torch.from_numpy(mpimg.imread(out))
    assert img.shape[0] >= 200 and img.shape[1] >= 300 and img.shape[2] in (3, 4), img.shape
    rgb = img[..., :3].float()
    white = _near(rgb, (255, 255, 255))
    assert white < rgb.shape[0] * rgb.shape[1], "blank (all white) image"
    # The train curve in C0 blue and the val curve in C1 orange are both drawn, with more than a
    # legend swatch's worth of pixels each (a swatch is ~20 x 2 px).
    assert _near(rgb, (0x1F, 0x77, 0xB4)) > 300, "no train curve (C0 blue) in the PNG"
    assert _near(rgb, (0xFF, 0x7F, 0x0E)) > 300, "no val curve (C1 orange) in the PNG"
    assert not list(out.parent.glob(".loss.png.*")), "temporary file left behind"
    ref = tmp_path / "ref"
    ref.write_bytes(b"")  # a file as open() creates it under this umask
    assert out.stat().st_mode & 0o777 == ref.stat().st_mode & 0o777, "not the umask's mode"

    with pytest.raises(ValueError, match=r"no loss in the 1 records"):
        plot_losses([{"step": 1, "loss": None}], tmp_path / "x.png", "t")


@pytest.mark.slow
def test_plot_losses_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import sys
        sys.modules["matplotlib"] = None  # as if not installed: `import matplotlib` raises
        from fusedzero.app.watch import plot_losses
        try:
            plot_losses([{{"step": 1, "loss": 2.0}}], {str(tmp_path / "x.png")!r}, "t")
        except ImportError as e:
            print("ERR:", e)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "ERR: plotting the loss curve needs matplotlib" in proc.stdout, proc.stdout
    assert "pip install 'fusedzero[plot]'" in proc.stdout, proc.stdout
    assert not (tmp_path / "x.png").exists()


# -- sample_text ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_gpt() -> GPT:
    torch.manual_seed(1234)
    model = GPT(GPTConfig(block_size=8, n_layer=2, n_head=2, n_embd=16))
    # Larger weights than GPT-2's 0.02 init: peaked logits, so greedy and sampling differ and
    # argmax ties (which a reference could break differently) do not occur.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.5)
    return model


def _reference(model: GPT, prompt: bytes, n: int, temperature: float, seed: int) -> bytes:
    """Token by token, by hand: crop to block_size, forward, argmax or multinomial."""
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ctx = torch.tensor([ids[-model.config.block_size :]])
            logits = model(ctx)[0][0, -1].float()
            if temperature == 0.0:
                ids.append(int(logits.argmax()))
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                ids.append(int(torch.multinomial(probs, 1, generator=gen)))
    return bytes(ids)


def test_sample_text_greedy_matches_stepwise_argmax_and_crops_context(tiny_gpt: GPT) -> None:
    # 10 prompt bytes + 13 new > block_size 8: the forward raises unless the context is cropped.
    prompt = "héllo, wo".encode()
    tiny_gpt.train()
    got = sample_text(tiny_gpt, prompt, 13)
    ref = _reference(tiny_gpt, prompt, 13, 0.0, 0)
    assert got == printable(ref)
    assert got.startswith("héllo, wo")  # the prompt's 2-byte é decoded whole
    assert tiny_gpt.training, "the model's own mode was not restored"
    assert all(p.grad is None for p in tiny_gpt.parameters())
    assert sample_text(tiny_gpt, prompt, 0) == "héllo, wo"


def test_sample_text_temperature_is_seeded_and_leaves_global_rng_alone(tiny_gpt: GPT) -> None:
    prompt = b"\nThe "
    torch.manual_seed(99)
    before = torch.get_rng_state()
    a = sample_text(tiny_gpt, prompt, 16, temperature=1.0, seed=7)
    b = sample_text(tiny_gpt, prompt, 16, temperature=1.0, seed=7)
    c = sample_text(tiny_gpt, prompt, 16, temperature=1.0, seed=8)
    greedy = sample_text(tiny_gpt, prompt, 16)
    assert torch.equal(torch.get_rng_state(), before), "the global RNG was used"
    assert a == b, "same seed, different text"
    ref = _reference(tiny_gpt, prompt, 16, 1.0, 7)
    assert a == printable(ref)
    # 16 draws at ~3.7 nats of entropy each: two seeds (or a seed and greedy) agreeing on all
    # of them is ~impossible.
    assert a != c and a != greedy


def test_sample_text_in_eval_mode_under_no_grad(tiny_gpt: GPT) -> None:
    prompt = b"abc"
    expected = sample_text(tiny_gpt, prompt, 10, temperature=0.7, seed=3)
    tiny_gpt.eval()
    try:
        with torch.no_grad():
            got = sample_text(tiny_gpt, prompt, 10, temperature=0.7, seed=3)
        assert not tiny_gpt.training, "eval mode was not restored"
        assert torch.is_grad_enabled(), "grad mode leaked out of sample_text"
    finally:
        tiny_gpt.train()
    assert got == expected


def test_sample_text_rejects_bad_arguments(tiny_gpt: GPT) -> None:
    with pytest.raises(ValueError, match=r"prompt is empty"):
        sample_text(tiny_gpt, b"", 4)
    with pytest.raises(ValueError, match=r"max_new_tokens must be >= 0, got -1"):
        sample_text(tiny_gpt, b"a", -1)
    for t in (-0.5, float("nan"), float("inf"), 1e-300, 1e39):  # 1e-300: NaN probs before
        with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or in"):
            sample_text(tiny_gpt, b"a", 4, temperature=t)
    with pytest.raises(ValueError, match=r"top_k must be >= 0"):
        sample_text(tiny_gpt, b"a", 4, temperature=1.0, top_k=-1)


def test_sample_text_top_k_keeps_only_the_likeliest_bytes(tiny_gpt: GPT) -> None:
    """top_k=1 is greedy at any temperature; top_k=3 draws only among each step's 3 likeliest
    bytes, checked step by step against the model's own logits."""
    prompt = b"\nde"
    assert sample_text(tiny_gpt, prompt, 12, temperature=5.0, top_k=1) == sample_text(
        tiny_gpt, prompt, 12
    )
    ids = list(prompt)
    got = sample_text(tiny_gpt, prompt, 12, temperature=5.0, top_k=3, seed=2)
    # Redo the draw with the reference filter and the same generator: the same bytes.
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _ in range(12):
            logits = tiny_gpt(torch.tensor([ids[-8:]]))[0][0, -1, :256].float()
            top = torch.topk(logits, 3).indices
            masked = torch.full_like(logits, float("-inf"))
            masked[top] = logits[top]
            nxt = int(torch.multinomial(torch.softmax(masked / 5.0, dim=-1), 1, generator=gen))
            assert nxt in top.tolist()
            ids.append(nxt)
    assert got == printable(bytes(ids))


def test_printable_decodes_the_whole_sequence_and_replaces_controls() -> None:
    """UTF-8 is decoded over the whole byte string (a byte-by-byte decode turns each byte of
    'é' into U+FFFD); invalid bytes and terminal controls become U+FFFD; newline and tab stay."""
    data = "é€".encode() + b"\tx\n" + b"\x1b[2J" + b"\r" + b"\xff" + b"\xc3"
    assert printable(data) == "é€\tx\n\ufffd[2J\ufffd\ufffd\ufffd"
    assert "".join(bytes([b]).decode("utf-8", errors="replace") for b in "é".encode()) != "é"
    assert printable("\u0085".encode()) == "\ufffd"  # a C1 control (NEL)
