"""fit_memory / plan_of on real models (CPU): gradients as the bare model's, peaks under budget."""

from __future__ import annotations

from collections.abc import Callable
import functools
import warnings

import pytest
import torch
from torch import nn
import torch.utils.checkpoint

import waterwave_hpo as ww
from waterwave_hpo.bench import BasicBlock
from waterwave_hpo.planning import PLANNERS
from waterwave_hpo.planning import CheckpointedModelError
from waterwave_hpo.planning import Placement
from waterwave_hpo.planning import PlanDoesNotFitError
from waterwave_hpo.planning import memory_ledger
from waterwave_hpo.planning import predict
from waterwave_hpo.planning import remove_memory_plan
from waterwave_hpo.planning import step_profile_of


def chain() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 128),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Linear(128, 128),
        nn.BatchNorm1d(128),
        nn.Tanh(),
        nn.Linear(128, 128),
        nn.ReLU(),
        nn.Linear(128, 5),
    )


class Block(nn.Module):
    """A residual MLP block with dropout: recompute pays off (saves much, takes one tensor)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(4 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(self.drop(torch.relu(self.fc1(x)))))


def residual() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), *[Block(64) for _ in range(4)], nn.Linear(64, 3))


def resnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        *[BasicBlock(8) for _ in range(3)],
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "chain": (chain, lambda: torch.randn(64, 32, generator=torch.Generator().manual_seed(1))),
    "residual": (
        residual,
        lambda: torch.randn(64, 16, generator=torch.Generator().manual_seed(1)),
    ),
    "resnet": (
        resnet,
        lambda: torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1)),
    ),
}


def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(123)  # dropout draws the same numbers in both runs
    loss = model(x).square().mean()
    loss.backward()  # type: ignore[no-untyped-call]
    return loss.detach()


def tight_budget(model: nn.Module, x: torch.Tensor, fraction: float = 0.5) -> int:
    """A budget a fraction of the way from the floor to what "keep everything" peaks at."""
    ww.fit_memory(model, 1 << 40, example_input=x, planner="none")
    profile = step_profile_of(model)
    keep = predict(profile, [Placement.KEEP] * len(profile.units)).peak_bytes
    return int(
        profile.static_bytes
        + profile.other_saved_bytes
        + fraction * (keep - profile.static_bytes - profile.other_saved_bytes)
    )


@functools.cache
def budget_for(name: str, planner: str) -> int:
    """Half-way from the floor to the unplanned peak; the greedy gets a looser 80%."""
    build, batch = MODELS[name]
    return tight_budget(build(), batch(), 0.8 if planner == "capuchin" else 0.5)


@pytest.mark.slow  # 18 cases of two profiled steps + two planned steps; ~1-2 s each unloaded
@pytest.mark.parametrize("planner", sorted(PLANNERS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_planner_trains_as_the_bare_model_within_its_predicted_peak(
    name: str, planner: str
) -> None:
    """Losses, gradients and buffers (BatchNorm statistics) equal the bare model's, bit for
    bit, dropout included, over two steps; the ledger's measured peak never exceeds the
    predicted peak, and for the budget-aware planners the budget."""
    build, batch = MODELS[name]
    x = batch()
    bare = build()
    bare_losses = [step(bare, x) for _ in range(2)]
    model = build()
    aware = planner in ("capuchin", "exhaustive", "pso")
    budget = budget_for(name, planner) if aware else 1 << 40
    ww.fit_memory(model, budget, example_input=x, planner=planner)
    if planner == "exhaustive":
        assert len(step_profile_of(model).units) <= 10
    plan = ww.plan_of(model)
    ledger = memory_ledger(model)
    static = step_profile_of(model).static_bytes
    losses = []
    for _ in range(2):
        ledger.reset_peak()
        losses.append(step(model, x))
        assert ledger.peak_bytes + static <= plan.predicted_peak_bytes
        assert ledger.current_bytes == 0  # every saved activation released after backward
    if aware:
        assert plan.predicted_peak_bytes <= budget
    assert [torch.equal(a, b) for a, b in zip(losses, bare_losses, strict=True)] == [True, True]
    for (pname, p), q in zip(model.named_parameters(), bare.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), pname
    for b, c in zip(model.buffers(), bare.buffers(), strict=True):
        assert torch.equal(b, c)


def test_a_tight_budget_moves_activations_off_the_device() -> None:
    x = MODELS["residual"][1]()
    model = residual()
    keep_peak = tight_budget(model, x, 1.0)
    budget = tight_budget(model, x, 0.3)
    ww.fit_memory(model, budget, example_input=x, planner="pso")
    plan = ww.plan_of(model)
    assert plan.planner == "pso" and plan.budget_bytes == budget
    assert set(plan.choices.values()) - {"keep"}
    assert plan.predicted_peak_bytes <= budget < keep_peak
    ledger = memory_ledger(model)
    ledger.reset_peak()
    step(model, x)
    assert ledger.peak_bytes + step_profile_of(model).static_bytes <= budget


def test_fit_memory_leaves_the_model_as_it_was() -> None:
    model = resnet()
    x = MODELS["resnet"][1]()
    params = [p.detach().clone() for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    rng = torch.random.get_rng_state()
    ww.fit_memory(model, 1 << 40, example_input=x)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers(), strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng, torch.random.get_rng_state())


def test_plan_of_and_remove() -> None:
    model = chain()
    with pytest.raises(ValueError, match=r"no memory plan; call waterwave_hpo\.fit_memory"):
        ww.plan_of(model)
    ww.fit_memory(model, 1 << 40, example_input=torch.randn(4, 32), planner="swap_all")
    assert set(ww.plan_of(model).choices.values()) == {"swap"}
    remove_memory_plan(model)
    with pytest.raises(ValueError, match="no memory plan"):
        ww.plan_of(model)
    assert "forward" not in model.__dict__


def test_budget_below_the_floor_names_the_floor() -> None:
    model = chain()
    opt = torch.optim.Adam(model.parameters())
    n = sum(p.numel() * 4 for p in model.parameters())
    floor = 4 * n  # parameters, gradients, two Adam moments
    with pytest.raises(ValueError, match=f"below the floor.*{floor} bytes"):
        ww.fit_memory(model, floor - 1, example_input=torch.randn(4, 32), optimizer=opt)


def test_budget_no_plan_reaches_raises() -> None:
    model = chain()
    x = torch.randn(64, 32)
    floor = sum(p.numel() * 8 for p in model.parameters())
    with pytest.raises(PlanDoesNotFitError, match="found no plan within budget_bytes"):
        ww.fit_memory(model, floor + 1, example_input=x, planner="exhaustive")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"budget_bytes": 1.5}, TypeError, r"^budget_bytes=1\.5: must be an int >= 1, not float"),
        ({"budget_bytes": 0}, ValueError, "^budget_bytes=0: must be >= 1"),
        ({"planner": "home"}, ValueError, "^planner='home': is not a planner; pass one of"),
        (
            {"optimizer": "adam"},
            TypeError,
            "^optimizer='adam': must be a torch.optim.Optimizer or None, not str",
        ),
        ({"seed": "0"}, TypeError, "^seed='0': must be an int, not str"),
        ({"bandwidth_bytes_per_s": -1}, ValueError, "^bandwidth_bytes_per_s=-1: must be > 0"),
    ],
)
def test_bad_arguments_name_themselves(kwargs: dict[str, object], error: type, match: str) -> None:
    args: dict[str, object] = {"budget_bytes": 1 << 30, **kwargs}
    budget = args.pop("budget_bytes")
    with pytest.raises(error, match=match):
        ww.fit_memory(chain(), budget, example_input=torch.randn(4, 32), **args)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^model='model': must be a torch\.nn\.Module, not str"):
        ww.fit_memory("model", 1 << 30, example_input=torch.randn(4, 32))  # type: ignore[arg-type]


class UserCheckpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return torch.utils.checkpoint.checkpoint(self.b, h, use_reentrant=self.reentrant)  # type: ignore[no-any-return]


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_model_already_checkpointed_is_refused(reentrant: bool) -> None:
    with pytest.raises(CheckpointedModelError, match=r"torch.utils.checkpoint"):
        ww.fit_memory(UserCheckpointed(reentrant), 1 << 30, example_input=torch.randn(4, 8))


def test_a_pipelined_model_is_refused_with_the_reason() -> None:
    model = ww.pipeline(chain())
    with pytest.raises(ValueError, match=r"ww\.pipeline gates.*profiled \(unplanned\) saved bytes"):
        ww.fit_memory(model, 1 << 30, example_input=torch.randn(4, 32))


class Whole(nn.Module):
    """No valid cut inside: the skip crosses everything."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(torch.relu(h)) + h


def test_a_model_without_cuts_is_one_unit_with_a_warning() -> None:
    x = torch.randn(4, 8)
    bare = Whole()
    model = Whole()
    model.load_state_dict(bare.state_dict())
    with pytest.warns(UserWarning, match="no valid cut.*one unit"):
        ww.fit_memory(model, 1 << 30, example_input=x, planner="checkpoint_sqrt")
    assert list(ww.plan_of(model).choices) == ["<model>"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(bare, x)
        step(model, x)
    for p, q in zip(model.parameters(), bare.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


class AttentionBlock(nn.Module):
    """Pre-norm self-attention: ``attn(h, h, h)`` must see one tensor three times when it is
    recomputed too (``nn.MultiheadAttention`` takes another path otherwise)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True, dropout=0.1)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("planner", ["checkpoint_sqrt", "swap_all"])
def test_attention_blocks_recompute_and_swap_bit_for_bit(planner: str) -> None:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), AttentionBlock(16), AttentionBlock(16))

    x = torch.randn(2, 6, 8)
    bare, model = build(), build()
    expected = step(bare, x)
    ww.fit_memory(model, 1 << 40, example_input=x, planner=planner)
    assert "recompute" in ww.plan_of(model).choices.values() or planner == "swap_all"
    ledger = memory_ledger(model)
    ledger.reset_peak()
    assert torch.equal(step(model, x), expected)
    for p, q in zip(model.parameters(), bare.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert ledger.peak_bytes + step_profile_of(model).static_bytes <= (
        ww.plan_of(model).predicted_peak_bytes
    )


def test_a_run_of_chained_recompute_units_keeps_only_its_first_input() -> None:
    """Consecutive layers of one nn.Sequential recomputed together are one checkpoint."""
    x = torch.randn(64, 32)
    model = chain()
    ww.fit_memory(model, 1 << 40, example_input=x, planner="none")
    profile = step_profile_of(model)
    assert all(u.chains_previous for u in profile.units[1:])
    everything = [Placement.RECOMPUTE] * len(profile.units)
    expected = profile.static_bytes + profile.units[0].input_bytes
    expected += sum(u.saved_bytes for u in profile.units)  # the whole run, recomputed at once
    expected += sum(u.random_bytes for u in profile.units)  # dropout's noise, kept to replay
    assert sum(u.random_bytes for u in profile.units) == 64 * 128 * 4
    assert predict(profile, everything).peak_bytes == expected


@pytest.mark.parametrize("planner", ["swap_all", "checkpoint_sqrt"])
def test_two_forwards_before_one_backward_accumulate_as_the_bare_model(planner: str) -> None:
    x1, x2 = torch.randn(8, 32), torch.randn(8, 32)
    bare, model = chain(), chain()
    torch.manual_seed(3)
    (bare(x1).sum() + bare(x2).square().sum()).backward()  # type: ignore[no-untyped-call]
    ww.fit_memory(model, 1 << 40, example_input=x1, planner=planner)
    torch.manual_seed(3)
    (model(x1).sum() + model(x2).square().sum()).backward()  # type: ignore[no-untyped-call]
    for p, q in zip(model.parameters(), bare.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert memory_ledger(model).current_bytes == 0
    with torch.no_grad():  # no plan work without a graph
        assert model(x1).shape == (8, 5)
