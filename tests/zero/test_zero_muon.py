"""ZeroMuon against torch.optim.Muon (the Muon groups) plus torch.optim.AdamW (the rest).

At one rank every stage holds each matrix whole, so the Muon groups run torch.optim.Muon's very
ops (See [Note: Muon numerics] in kernels/_muon.py): with the AdamW groups' lr at 0 (their
params fixed in both runs) the Muon params are bit-identical over several steps. With AdamW
live, the AdamW kernel's fp32 op order differs from torch's by an ulp (as ZeroAdamW alone,
test_optimizer.py), and that difference reaches every param through the forward: the
comparison then takes a tolerance beside its noise control. Over two ranks at stage 0 every
rank runs Newton-Schulz on every matrix (as DDP + Muon); at stages 1-3 the owner layout
(fusedzero/_owner_layout.py) puts each matrix whole on one rank.

About internals: fusedzero.rules._muon (the Muon rule's state field and defaults),
fusedzero.checkpoint._catalog and fusedzero.checkpoint._manifest (the manifest's group rules).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from fusedzero import Precision, Sharding, ZeroMuon, muon_param_groups
from fusedzero.app.model import GPTConfig
from fusedzero.plan import PlanConfig, plan_groups
from fusedzero.testing import fake_group, run_ranks

from _helpers import gpt_batch, make_gpt

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
BATCH = 4
# lr values exact in fp32: torch's Python-float lr and our fp32 lr vector agree.
MUON_HP = dict(lr=float(torch.tensor(0.02)), weight_decay=0.1, momentum=0.95)


def _loss(model: nn.Module, step: int, batch: int = BATCH) -> torch.Tensor:
    x, y = gpt_batch(CFG, batch, step)
    return model(x, y)[1]


def _reference(model: nn.Module, adamw: dict[str, Any]) -> tuple[Any, Any]:
    groups = muon_param_groups(model)
    muon = torch.optim.Muon(groups[0]["params"], **MUON_HP)
    aw = torch.optim.AdamW(groups[1]["params"], **adamw)
    return muon, aw


def _zero(model: nn.Module, adamw: dict[str, Any], stage: int, **kw: Any) -> ZeroMuon:
    return ZeroMuon(
        muon_param_groups(model, muon=MUON_HP, adamw=adamw), stage=stage, module=model, **kw
    )


def _ref_step(
    model: nn.Module, opts: tuple[Any, Any], step: int, clip: float | None, batch: int = BATCH
) -> None:
    _loss(model, step, batch).backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    for o in opts:
        o.step()
        o.zero_grad()


def _params(model: nn.Module, opt: ZeroMuon) -> dict[str, torch.Tensor]:
    with opt.gathered_params():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    bad = (a != b).nonzero()
    if len(bad) == 0:
        return "equal"
    i = tuple(bad[0].tolist())
    return f"{len(bad)} differ, first at {i}: {a[i].item()!r} vs {b[i].item()!r}"


def test_muon_param_groups_split_hidden_matrices_from_the_rest() -> None:
    """Hidden 2-D matrices to Muon; the embeddings (the head is tied to one), norms and biases
    to AdamW; a name override moves a matrix; a 3-D stack is Muon's; 1-D forced into Muon is
    refused naming it."""
    model = make_gpt(CFG)
    g = muon_param_groups(model, muon=dict(lr=0.02))
    names = {id(p): n for n, p in model.named_parameters()}
    muon = [names[id(p)] for p in g[0]["params"]]
    rest = [names[id(p)] for p in g[1]["params"]]
    assert g[0]["use_muon"] is True and g[0]["lr"] == 0.02 and g[1]["use_muon"] is False
    assert muon == [
        f"blocks.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    ]
    assert "wte.weight" in rest and "wpe.weight" in rest and "ln_f.weight" in rest
    assert all(
        model.get_parameter(n).ndim == 1 for n in rest if n not in ("wte.weight", "wpe.weight")
    )
    moved = muon_param_groups(model, use_muon={"blocks.0.attn.*": False})
    assert len(moved[0]["params"]) == 6
    with pytest.raises(ValueError, match="ln_f.weight"):
        muon_param_groups(model, use_muon={"ln_f.weight": True})

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4, 8, 16))
            self.lm_head = nn.Linear(16, 8)

    e = muon_param_groups(Experts())
    assert [p.shape for p in e[0]["params"]] == [(4, 8, 16)]
    assert len(e[1]["params"]) == 2  # the head's weight and bias


@pytest.mark.parametrize(
    ("stage", "bucket_numel", "backend"),
    [(s, b, "torch") for s in range(4) for b in (None, 1024)] + [(2, 1024, "triton")],
)
def test_muon_groups_are_bitwise_torch_optim_muon(
    stage: int, bucket_numel: int | None, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five steps of the small GPT at one rank: every Muon param and momentum buffer equals
    torch.optim.Muon's bit for bit (the AdamW groups at lr 0, so they stay fixed in both runs
    and nothing else differs), and the AdamW params are untouched; with buckets of 1024
    elements too, where matrices straddle buckets (still whole on the one rank); and through
    the Triton kernels (the interpreter) at stage 2."""
    monkeypatch.setenv("FUSEDZERO_BACKEND", backend)
    adamw = dict(lr=0.0, weight_decay=0.0)
    model = make_gpt(CFG)
    ref = copy.deepcopy(model)
    opt = _zero(model, adamw, stage, sharding=Sharding(bucket_numel=bucket_numel))
    ref_opts = _reference(ref, adamw)
    for step in range(5):
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad()
        _ref_step(ref, ref_opts, step, None)
    got = _params(model, opt)
    for n, q in ref.named_parameters():
        assert torch.equal(got[n], q.detach()), f"{n}: {_first_diff(got[n], q.detach())}"
    st = opt.shard_state()
    refs = dict(zip(map(id, model.parameters()), ref.parameters(), strict=True))
    for info, buf in zip(opt.shard_infos(), st.momentum_buffer, strict=True):
        if buf is None:
            continue
        for seg in info.segments():
            want = ref_opts[0].state[refs[id(opt.params[seg.param])]]["momentum_buffer"]
            got_b = buf[seg.local : seg.local + seg.length]
            assert torch.equal(got_b, want.reshape(-1)[seg.start : seg.start + seg.length])
    opt.close()


def _reference_and_noise(
    adamw: dict[str, Any], clip: float | None, steps: int, batch: int = BATCH
) -> tuple[dict[str, torch.Tensor], float]:
    """The reference's params after `steps` steps on batches of `batch` sequences, and the noise
    control: how far the same reference moves them when each loss is taken as the mean of two
    half-batch losses (the same math, another summation order; the difference an ulp makes once
    Newton-Schulz rounds its input to bf16)."""
    base = make_gpt(CFG)
    ref = copy.deepcopy(base)
    opts = _reference(ref, adamw)
    for step in range(steps):
        _ref_step(ref, opts, step, clip, batch)
    want = {n: p.detach() for n, p in ref.named_parameters()}
    noisy = copy.deepcopy(base)
    opts = _reference(noisy, adamw)
    h = batch // 2
    for step in range(steps):
        x, y = gpt_batch(CFG, batch, step)
        ((noisy(x[:h], y[:h])[1] + noisy(x[h:], y[h:])[1]) / 2).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(noisy.parameters(), clip)
        for o in opts:
            o.step()
            o.zero_grad()
    noise = max((p.detach() - want[n]).abs().max().item() for n, p in noisy.named_parameters())
    # An element moves by about lr (0.02, times adjust_lr's ratio) per step: the control must
    # stay well below that, or it would hide a wrong update.
    assert 0.0 < noise < 5e-3, f"noise control moved the params by {noise}"
    return want, noise


def _assert_within(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float, where: str
) -> None:
    for n, w in want.items():
        d = (got[n] - w).abs().max().item()
        assert d <= tol, f"{where} {n}: max diff {d} > {tol} (2x the noise control)"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_muon_matches_muon_plus_adamw_with_clipping_and_accumulation(stage: int) -> None:
    """Four steps with live AdamW groups and clipping by global norm: the params match
    torch.optim.Muon + torch.optim.AdamW after `clip_grad_norm_`, and so does the same run with
    each batch in two accumulated micro-batches, within 2x the noise control (the reference
    against itself with each loss over two half batches: about 1e-3 here). Bitwise is out of
    reach with live AdamW: its kernel differs from torch's op order by an ulp, which a bf16
    rounding of Newton-Schulz's input turns into a bf16 ulp of the update."""
    adamw = dict(lr=1e-3, weight_decay=0.01)
    clip = 0.5
    want, noise = _reference_and_noise(adamw, clip, 4)
    for micro in (1, 2):
        model = make_gpt(CFG)
        opt = _zero(model, adamw, stage, max_grad_norm=clip)
        for step in range(4):
            x, y = gpt_batch(CFG, BATCH, step)
            for k in range(micro):
                sl = slice(k * BATCH // micro, (k + 1) * BATCH // micro)
                (model(x[sl], y[sl])[1] / micro).backward()
            opt.step()
            opt.zero_grad()
        _assert_within(_params(model, opt), want, 2 * noise, f"micro={micro}")
        opt.close()


@pytest.mark.parametrize("stage", [1, 2])
def test_schedulers_changed_hyper_parameters_and_no_sync_stay_bitwise(stage: int) -> None:
    """An lr scheduler on both kinds of group, momentum, nesterov, weight decay and
    adjust_lr_fn changed between steps (the rows rewritten), and two micro-batches under
    `no_sync`: the Muon params still equal torch.optim.Muon's bit for bit (AdamW at lr 0)."""
    adamw = dict(lr=0.0, weight_decay=0.0)
    model = make_gpt(CFG)
    ref = copy.deepcopy(model)
    opt = _zero(model, adamw, stage)
    ref_opts = _reference(ref, adamw)
    # Halving keeps every lr exact in fp32, the lr vector's dtype (torch's lr is a Python float;
    # an lr that fp32 rounds would differ by that rounding, as in ZeroAdamW).
    lam = lambda step: 0.5**step  # noqa: E731
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lam) for o in (opt, *ref_opts)]
    changes = {2: dict(momentum=0.9, weight_decay=0.05), 3: dict(nesterov=False)}
    changes[4] = dict(adjust_lr_fn="match_rms_adamw")
    for step in range(6):
        for g in (opt.param_groups[0], ref_opts[0].param_groups[0]):
            g.update(changes.get(step, {}))
        x, y = gpt_batch(CFG, BATCH, step)
        with opt.no_sync():
            (model(x[:2], y[:2])[1] / 2).backward()
        (model(x[2:], y[2:])[1] / 2).backward()
        opt.step()
        opt.zero_grad()
        (ref(x[:2], y[:2])[1] / 2).backward()
        (ref(x[2:], y[2:])[1] / 2).backward()
        for o in ref_opts:
            o.step()
            o.zero_grad()
        for sch in scheds:
            sch.step()
    got = _params(model, opt)
    for n, q in ref.named_parameters():
        assert torch.equal(got[n], q.detach()), f"{n}: {_first_diff(got[n], q.detach())}"
    opt.close()


@pytest.mark.parametrize("stage", [0, 3])
def test_state_dict_round_trip_steps_identically(stage: int) -> None:
    """A state dict carries the Muon momentum and the AdamW moments, each in its own buffers,
    into a fresh ZeroMuon, which then steps bit-identically to the original."""
    adamw = dict(lr=1e-3)
    a = make_gpt(CFG)
    b = copy.deepcopy(a)
    opt_a = _zero(a, adamw, stage)
    for step in range(2):
        _loss(a, step).backward()
        opt_a.step()
    opt_b = _zero(b, adamw, stage)
    sd = opt_a.state_dict()
    kinds = [set(d) for d in sd["state"]["flat"]]
    assert {"master", "momentum_buffer"} in kinds and {"master", "exp_avg", "exp_avg_sq"} in kinds
    opt_b.load_state_dict(sd)
    for m, o in ((a, opt_a), (b, opt_b)):
        for step in range(2, 4):
            _loss(m, step).backward()
            o.step()
    pa, pb = _params(a, opt_a), _params(b, opt_b)
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n
    opt_a.close()
    opt_b.close()


class _Experts(nn.Module):
    """Three expert matrices as one [3, 8, 16] stack (or as three 2-D params), and a bias."""

    def __init__(self, stacked: bool, init: torch.Tensor) -> None:
        super().__init__()
        if stacked:
            self.w = nn.Parameter(init.clone())
        else:
            self.ws = nn.ParameterList(nn.Parameter(m.clone()) for m in init)
        self.b = nn.Parameter(torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ws = self.w.unbind(0) if hasattr(self, "w") else list(self.ws)
        return sum(((x @ w + self.b).tanh().square().mean() for w in ws), torch.zeros(()))


@pytest.mark.parametrize("stage", [0, 2])
def test_a_3d_expert_stack_is_its_matrices(stage: int) -> None:
    """A [E, M, N] param is E matrices of M x N (torch.optim.Muon refuses 3-D): each is
    orthogonalised alone, with the lr adjusted by M x N; the stack equals torch.optim.Muon over
    E separate 2-D params bit for bit (the bias's AdamW at lr 0)."""
    g = torch.Generator().manual_seed(3)
    init = torch.randn(3, 8, 16, generator=g)
    stacked, split = _Experts(True, init), _Experts(False, init)
    hp = dict(MUON_HP, adjust_lr_fn="match_rms_adamw")
    opt = ZeroMuon(
        muon_param_groups(stacked, muon=hp, adamw=dict(lr=0.0)), stage=stage, module=stacked
    )
    ref = torch.optim.Muon(list(split.ws), **hp)
    for _ in range(3):
        x = torch.randn(4, 8, generator=g)
        stacked(x).backward()
        opt.step()
        split(x).backward()
        ref.step()
        ref.zero_grad()
    with opt.gathered_params():
        for e in range(3):
            assert torch.equal(stacked.w[e], split.ws[e]), f"expert {e}"
    opt.close()


def test_a_checkpoint_reshards_across_stages_and_resumes_bit_exactly(tmp_path) -> None:
    """Saved at stage 1, the manifest names each group's rule and each buffer's file holds its
    rule's fields; loaded into a fresh ZeroMuon at stage 3 (other buffers, other layout) and at
    stage 1, both continue bit-identically to the run that saved. A ZeroAdamW refuses it,
    naming a Muon param whose momentum it cannot take."""
    from fusedzero import ZeroAdamW, checkpoint
    from fusedzero.checkpoint._catalog import read_manifest
    from fusedzero.checkpoint._manifest import validate

    adamw = dict(lr=1e-3)
    a = make_gpt(CFG)
    opt_a = _zero(a, adamw, 1)
    for step in range(2):
        _loss(a, step).backward()
        opt_a.step()
    saved = checkpoint.save(opt_a, tmp_path, step=2).wait()
    m = read_manifest(saved)
    assert m["rule"] == "by-group" and m["group_rules"] == ["muon", "adamw"]
    for bad, msg in (
        (["muon"], "has 1 entries for 2 param groups"),
        (["muon", "lion"], "each one of"),
        ([["muon"], "adamw"], "each one of"),
    ):
        with pytest.raises(checkpoint.CheckpointError, match=msg):
            validate({**m, "group_rules": bad}, saved / "manifest.json")
    for step in range(2, 4):
        _loss(a, step).backward()
        opt_a.step()
    want = _params(a, opt_a)
    opt_a.close()
    for stage in (3, 1):
        b = make_gpt(CFG, seed=1)
        opt_b = _zero(b, adamw, stage)
        checkpoint.load(opt_b, saved)
        for step in range(2, 4):
            _loss(b, step).backward()
            opt_b.step()
        got = _params(b, opt_b)
        for n, w in want.items():
            assert torch.equal(got[n], w), f"stage {stage} {n}: {_first_diff(got[n], w)}"
        opt_b.close()
    c = make_gpt(CFG)
    opt_c = ZeroAdamW(c.parameters(), stage=1, module=c)
    with pytest.raises(checkpoint.CheckpointError, match="holds muon state for blocks.0"):
        checkpoint.load(opt_c, saved)
    opt_c.close()


@pytest.mark.interpreter
@pytest.mark.parametrize("stage", [0, 2])
def test_one_launch_per_rule_and_the_adamw_rows_in_the_scalar_launch(
    stage: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the Triton path (the interpreter): a step issues one momentum and one update launch
    for every Muon matrix of the rank, one AdamW launch for the AdamW groups, and the
    step-scalar launch, which writes AdamW's rows (no launch of their own) although the Muon
    rule comes first: no launch per group or per buffer."""
    from fusedzero.kernels import LAUNCHES

    monkeypatch.setenv("FUSEDZERO_BACKEND", "triton")
    model = make_gpt(CFG)
    opt = _zero(model, dict(lr=1e-3), stage, max_grad_norm=1.0)
    _loss(model, 0).backward()
    before = LAUNCHES.copy()
    opt.step()
    got = {k: v - before.get(k, 0) for k, v in LAUNCHES.items() if v != before.get(k, 0)}
    want = {"muon_momentum": 1, "muon_update": 1, "adamw": 1, "step_scalars": 1}
    assert {k: v for k, v in got.items() if k in (*want, "rows")} == want, got
    opt.close()


def test_hyper_parameters_defaults_and_refusals() -> None:
    """Muon groups take torch.optim.Muon's defaults, AdamW groups AdamW's; bad values are
    refused as torch refuses them; int8 state, a bf16 master and a 1-D param in a Muon group
    are refused naming the fix; bf16 momentum halves the Muon state."""
    model = make_gpt(CFG)
    opt = ZeroMuon(muon_param_groups(model), stage=1, module=model)
    muon_g, adam_g = opt.param_groups
    assert muon_g["lr"] == 1e-3 and muon_g["weight_decay"] == 0.1 and muon_g["momentum"] == 0.95
    assert muon_g["nesterov"] is True and muon_g["ns_steps"] == 5 and muon_g["eps"] == 1e-7
    assert muon_g["ns_coefficients"] == (3.4445, -4.7750, 2.0315)
    assert muon_g["adjust_lr_fn"] is None and "betas" not in muon_g
    assert adam_g["betas"] == (0.9, 0.999) and adam_g["weight_decay"] == 1e-2
    n_muon = sum(p.numel() for p in muon_g["params"])
    opt.close()
    for bad, msg in (
        (dict(momentum=-0.1), "momentum should be >= 0"),
        (dict(weight_decay=-1.0), "weight decay should be >= 0"),
        (dict(lr=-1.0), "Learning rate should be >= 0"),
        (dict(adjust_lr_fn="nope"), "Adjust learning rate function nope"),
        (dict(ns_steps=100), "ns_steps"),
        # finite in Python, inf in the fp32 update (torch would run it in float64)
        (dict(lr=1e39), "lr should be finite in fp32"),
        (dict(weight_decay=float("inf")), "weight_decay should be finite in fp32"),
        (dict(momentum=1e39), "momentum should be finite in fp32"),
    ):
        with pytest.raises(ValueError, match=msg):
            ZeroMuon(muon_param_groups(model, muon=bad), module=model)
    # Refused before anything touches the model: it builds afterwards, at stage 3 too.
    with pytest.raises(ValueError, match="not 'int8'"):
        ZeroMuon(
            muon_param_groups(model), stage=3, module=model, precision=Precision(states="int8")
        )
    with pytest.raises(ValueError, match="master='fp32'"):
        ZeroMuon(
            muon_param_groups(model),
            stage=3,
            module=model,
            precision=Precision(param_dtype=torch.bfloat16, master="bf16-kahan"),
        )
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ZeroMuon(muon_param_groups(model), stage=3, module=model).close()
    with pytest.raises(ValueError, match="ln_f.weight of shape \\(32,\\)"):
        ZeroMuon([{"params": [model.ln_f.weight], "use_muon": True}], module=model)
    with pytest.raises(ValueError, match="has no 'use_muon'"):
        ZeroMuon([{"params": list(model.parameters())}], module=model)
    half = ZeroMuon(muon_param_groups(model), module=model, precision=Precision(states="bf16"))
    full = sum(i.local_numel for i in half.shard_infos() if i.group_index == 0)
    assert full >= n_muon
    adam = sum(i.local_numel for i in half.shard_infos() if i.group_index == 1)
    # bf16 momentum (2 B) and the bf16 Newton-Schulz scratch (2 B) per Muon shard element
    assert half.memory().optimizer == (2 + 2) * full + 4 * adam
    half.close()


@pytest.mark.parametrize("states", ["fp32", "bf16"])
def test_memory_equals_plan_with_each_group_s_rule(states: str) -> None:
    """`plan` with each group's rule (`PlanConfig(group_rules=)`) predicts `opt.memory()`'s
    optimizer bytes to the byte at every stage, momentum in fp32 and in bf16: the Muon buffers
    count one field, the AdamW buffers two."""
    for stage in (0, 1, 2, 3):
        model = make_gpt(CFG)
        twin = copy.deepcopy(model)  # full shapes: at stage 3 the model's params are freed
        names = {id(p): n for n, p in twin.named_parameters()}
        groups = [[(names[id(p)], p) for p in g["params"]] for g in muon_param_groups(twin)]
        precision = Precision(param_dtype=torch.float32, states=states)
        opt = ZeroMuon(muon_param_groups(model), stage=stage, module=model, precision=precision)
        cfg = PlanConfig(world_size=1, precision=precision, group_rules=tuple(opt.group_rules))
        plan = plan_groups(groups, cfg, model=twin)
        assert plan.stages[stage].optimizer_bytes == opt.memory().optimizer, stage
        opt.close()


@pytest.mark.parametrize("W", [2, 4, 8])
def test_each_matrix_is_whole_on_exactly_one_owner_at_stages_1_to_3(W: int) -> None:
    """Over W ranks (rank r of a fake group, one at a time) at stages 1-3, the Muon rule's
    launches see whole matrices only, and every Muon matrix is held by exactly one rank (the
    stage-3 units too); the AdamW buffers keep the equal-slice layout."""
    for stage in (1, 2, 3):
        held: dict[int, list[int]] = {}
        for r in range(W):
            with fake_group(r, W):
                model = make_gpt(CFG)
                groups = muon_param_groups(model)
                muon = {id(p) for p in groups[0]["params"]}
                opt = ZeroMuon(groups, stage=stage, module=model, device="cpu")
                want = {i for i, p in enumerate(opt.params) if id(p) in muon}
                for buf in opt.flat_groups:
                    if opt.group_rules[buf.group_index].name != "muon":
                        continue
                    for t in buf.local_shard().whole_tensors():  # raises on a cut matrix
                        held.setdefault(t.param, []).append(r)
                opt.close()
        assert sorted(held) == sorted(want), (stage, W)
        assert all(len(rs) == 1 for rs in held.values()), (stage, W, held)
        if W <= 4:  # 8 matrices in 6 bins: every rank owns some, at stage 3 too, where each
            # unit is laid out on its own and the per-rank cost carries from unit to unit
            assert {rs[0] for rs in held.values()} == set(range(W)), (stage, held)


def test_a_tensor_parallel_shard_in_a_muon_group_is_refused() -> None:
    """A column-parallel weight is a piece of its matrix on each tp rank; Newton-Schulz on it
    would be wrong, so a Muon group holding it is refused, naming the param and its placement;
    the same model builds once that layer is left unsharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from fusedzero import Groups

    with fake_group(0, 2):
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        dp = Groups(shard=mesh["dp"].get_group())
        m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        parallelize_module(m, mesh["tp"], {"0": ColwiseParallel()})
        with pytest.raises(NotImplementedError, match=r"0\.weight is a tensor-parallel shard"):
            ZeroMuon(muon_param_groups(m), stage=0, module=m, groups=dp, device="cpu")
        groups = muon_param_groups(m, use_muon={"0.*": False})
        ZeroMuon(groups, stage=0, module=m, groups=dp, device="cpu").close()


def _w2_stage0(rank: int, world: int) -> dict[str, Any]:
    adamw = dict(lr=1e-3, weight_decay=0.01)
    model = make_gpt(CFG)
    opt = _zero(model, adamw, 0)
    for step in range(3):
        x, y = gpt_batch(CFG, BATCH, step)
        h = BATCH // world
        model(x[rank * h : (rank + 1) * h], y[rank * h : (rank + 1) * h])[1].backward()
        opt.step()
    return {"params": _params(model, opt)}


@pytest.mark.slow
def test_two_ranks_stage0_match_the_single_process_reference() -> None:
    """Two gloo ranks at stage 0, each with half of every batch (grads averaged as DDP): every
    rank runs Newton-Schulz on every matrix and both hold the same params, which match the
    single-process Muon + AdamW on the whole batch within 2x the noise control (the grads differ
    from the reference's by the summation order of the batch mean: the control's very noise)."""
    outs = run_ranks(_w2_stage0, 2)
    want, noise = _reference_and_noise(dict(lr=1e-3, weight_decay=0.01), None, 3)
    for n in want:
        assert torch.equal(outs[0]["params"][n], outs[1]["params"][n]), f"ranks differ: {n}"
    _assert_within(outs[0]["params"], want, 2 * noise, "W=2 stage 0")


def _momenta(opt: ZeroMuon) -> dict[str, torch.Tensor]:
    """Each Muon param's momentum buffer, whole, by name (one rank holds every matrix whole)."""
    st, out = opt.shard_state(), {}
    shapes = {p.index: p.shape for p in opt.param_infos()}  # stage 3: the params are freed
    for info, buf in zip(opt.shard_infos(), st.momentum_buffer, strict=True):
        for seg in info.segments() if buf is not None else ():
            name = opt.param_names[seg.param]
            out.setdefault(name, torch.zeros(shapes[seg.param]).view(-1))
            out[name][seg.start : seg.start + seg.length] = buf[seg.local : seg.local + seg.length]
    return out


def _w2_save(rank: int, world: int, path: str) -> dict[str, Any]:
    from fusedzero import checkpoint

    model = make_gpt(CFG)
    opt = _zero(model, dict(lr=1e-3), 0)
    for step in range(2):
        x, y = gpt_batch(CFG, BATCH, step)
        h = BATCH // world
        model(x[rank * h : (rank + 1) * h], y[rank * h : (rank + 1) * h])[1].backward()
        opt.step()
    checkpoint.save(opt, path, step=2).wait()
    return {"params": _params(model, opt), "momenta": _momenta(opt)}


@pytest.mark.slow
def test_a_two_rank_checkpoint_loads_on_one_rank_at_stage_3(tmp_path) -> None:
    """Saved by two gloo ranks at stage 0, loaded by one rank at stage 3 (other world size,
    stage and buffers): every param and every Muon momentum buffer is the saved one, bit for
    bit (momentum is saved per param, whatever the layout)."""
    from fusedzero import checkpoint

    outs = run_ranks(_w2_save, 2, str(tmp_path))
    model = make_gpt(CFG, seed=1)
    opt = _zero(model, dict(lr=1e-3), 3)
    checkpoint.load(opt, tmp_path)
    got = _params(model, opt)
    for n, w in outs[0]["params"].items():
        assert torch.equal(got[n], w), n
    mine = _momenta(opt)
    assert sorted(mine) == sorted(outs[0]["momenta"]) and len(mine) == 8
    for n, w in outs[0]["momenta"].items():
        assert torch.equal(mine[n], w), n
    opt.close()
