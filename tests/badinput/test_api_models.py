"""Bad arguments to the model-level API: plans, NodeGroups, fusion (table-driven).

Every case: the exception type, the argument, the value and a fix in the message; the model
is left as it was (its parameters, and a plan or gates it had).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import pytest
import torch
from torch import nn

from badinput._helpers import Case
from badinput._helpers import case_params
import waterwave_hpo as ww
from waterwave_hpo import fusion
from waterwave_hpo import planning
from waterwave_hpo.nodegroup import partition


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


_X = torch.randn(4, 5)


def _fit(**kwargs: Any) -> Callable[[], object]:
    arguments: dict[str, Any] = {"budget_bytes": 1 << 30, "example_input": _X}
    arguments.update(kwargs)
    model = arguments.pop("model", None) or _mlp()
    return lambda: ww.fit_memory(model, **arguments)


FIT_MEMORY = [
    Case("model-str", _fit(model="mlp"), TypeError, "model", "'mlp'", "type"),
    Case("budget-zero", _fit(budget_bytes=0), ValueError, "budget_bytes", "0", "range"),
    Case("budget-negative", _fit(budget_bytes=-1), ValueError, "budget_bytes", "-1", "range"),
    Case("budget-float", _fit(budget_bytes=1e9), TypeError, "budget_bytes", "1000000000.0", "type"),
    Case("budget-str", _fit(budget_bytes="1GB"), TypeError, "budget_bytes", "'1GB'", "type"),
    Case("budget-below-floor", _fit(budget_bytes=10), ValueError, "budget_bytes", "10", "range"),
    Case("planner-word", _fit(planner="best"), ValueError, "planner", "'best'", "range"),
    Case("optimizer-str", _fit(optimizer="adam"), TypeError, "optimizer", "'adam'", "type"),
    Case("seed-float", _fit(seed=1.5), TypeError, "seed", "1.5", "type"),
    Case(
        "bandwidth-zero",
        _fit(bandwidth_bytes_per_s=0),
        ValueError,
        "bandwidth_bytes_per_s",
        "0",
        "range",
    ),
    Case("input-none", _fit(example_input=None), TypeError, "example_input", "None", "type"),
    Case(
        "input-wrong-shape",
        _fit(example_input=torch.randn(4, 3)),
        ValueError,
        "example_input",
        "shape (4, 3)",
        "range",
    ),
    Case(
        "input-wrong-dtype",
        _fit(example_input=torch.zeros(4, 5, dtype=torch.long)),
        ValueError,
        "example_input",
        "torch.int64",
        "type",
    ),
    Case("input-str", _fit(example_input="batch"), ValueError, "example_input", "'batch'", "type"),
    Case(
        "input-no-grad",
        _fit(model=nn.ReLU()),
        ValueError,
        "example_input",
        "requires grad",
        "range",
    ),
]


@pytest.mark.parametrize("case", case_params(FIT_MEMORY))
def test_fit_memory_refuses(case: Case) -> None:
    case.check()


def test_plan_lookups_before_fit_memory_name_the_fix() -> None:
    model = _mlp()
    for lookup in (ww.plan_of, planning.step_profile_of, planning.memory_ledger):
        Case(
            lookup.__name__, lambda f=lookup: f(model), ValueError, "model", "Sequential", "order"
        ).check()
    planning.remove_memory_plan(model)  # no plan: a no-op, as documented


@settings(max_examples=25, deadline=None)
@given(
    budget=st.one_of(
        st.integers(max_value=0),
        st.floats(allow_nan=True),
        st.text(max_size=5),
        st.none(),
        st.booleans(),
    )
)
def test_fit_memory_budget_property(budget: object) -> None:
    """Any budget that is not an int > 0 is refused, naming budget_bytes and the value."""
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises((TypeError, ValueError), match=r"budget_bytes=") as caught:
        ww.fit_memory(model, budget, example_input=_X)  # type: ignore[arg-type]
    assert repr(budget) in str(caught.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


# -- pipeline / node_groups / partition ------------------------------------------------------

NODEGROUPS = [
    Case("pipeline-model", lambda: ww.pipeline("m"), TypeError, "model", "'m'", "type"),
    Case(
        "pipeline-groups-zero",
        lambda: ww.pipeline(_mlp(), groups=0),
        ValueError,
        "groups",
        "0",
        "range",
    ),
    Case(
        "pipeline-groups-word",
        lambda: ww.pipeline(_mlp(), groups="many"),
        TypeError,
        "groups",
        "'many'",
        "type",
    ),
    Case(
        "pipeline-input-shape",
        lambda: ww.pipeline(_mlp(), example_input=torch.randn(2, 7)),
        ValueError,
        "example_input",
        "shape (2, 7)",
        "range",
    ),
    Case(
        "node-groups-bare",
        lambda: ww.node_groups(_mlp()),
        ValueError,
        "model",
        "Sequential",
        "order",
    ),
    Case(
        "node-groups-unprofiled",
        lambda: ww.node_groups(ww.pipeline(_mlp())),
        RuntimeError,
        "profiled",
        "example_input",
        "order",
    ),
    Case("partition-k-zero", lambda: partition([1, 2, 3], 0), ValueError, "k", "0", "range"),
    Case("partition-sizes-neg", lambda: partition([1, -2], 1), ValueError, "sizes", "-2", "range"),
    Case("partition-empty", lambda: partition([], 1), ValueError, "sizes", "[]", "range"),
]


@pytest.mark.parametrize("case", case_params(NODEGROUPS))
def test_nodegroup_api_refuses(case: Case) -> None:
    case.check()


def test_fit_memory_on_gated_model_is_refused_and_gates_stay() -> None:
    model = ww.pipeline(_mlp(), example_input=_X)
    groups = ww.node_groups(model)
    with pytest.raises(ValueError, match=r"ww\.pipeline gates.*Use one or the other"):
        ww.fit_memory(model, 1 << 30, example_input=_X)
    assert ww.node_groups(model) == groups


# -- fusion ---------------------------------------------------------------------------------

FUSION = [
    Case("fuse-empty", lambda: fusion.fuse([]), ValueError, "models", "[]", "range"),
    Case("fuse-str", lambda: fusion.fuse("ab"), TypeError, "models[0]", "'a'", "type"),
    Case(
        "fuse-mixed",
        lambda: fusion.fuse([nn.Linear(2, 3), nn.Linear(3, 3)]),
        ValueError,
        "models[1]",
        "Linear",
        "range",
    ),
    Case(
        "fuse-kernels-str",
        lambda: fusion.fuse([nn.Linear(2, 3)] * 2, kernels="yes"),
        TypeError,
        "kernels",
        "'yes'",
        "type",
    ),
    Case("structure-key-str", lambda: fusion.structure_key("m"), TypeError, "model", "'m'", "type"),
    Case(
        "optimizer-cls",
        lambda: fusion.optimizer(
            torch.optim.LBFGS, fusion.fuse([nn.Linear(2, 3)] * 2), [{"lr": 0.1}] * 2
        ),
        ValueError,
        "cls",
        "LBFGS",
        "range",
    ),
    Case(
        "optimizer-hparams-count",
        lambda: fusion.optimizer(
            torch.optim.SGD, fusion.fuse([nn.Linear(2, 3)] * 2), [{"lr": 0.1}] * 3
        ),
        ValueError,
        "hparams",
        "3",
        "range",
    ),
    Case(
        "optimizer-lr-negative",
        lambda: fusion.optimizer(
            torch.optim.SGD, fusion.fuse([nn.Linear(2, 3)] * 2), [{"lr": -1.0}, {"lr": 0.1}]
        ),
        ValueError,
        "lr",
        "-1.0",
        "range",
    ),
    Case(
        "dropout-p",
        lambda: fusion.PerModelDropout(p=1.5),
        ValueError,
        "p",
        "1.5",
        "range",
    ),
    Case(
        "loss-shape",
        lambda: fusion.per_model_loss(
            nn.functional.mse_loss, torch.randn(2, 4, 3), torch.randn(5, 3)
        ),
        ValueError,
        "target",
        "(5, 3)",
        "range",
    ),
    Case(
        "clip-max-norm",
        lambda: fusion.clip_grad_norm_(fusion.fuse([nn.Linear(2, 3)] * 2), -1.0),
        ValueError,
        "max_norm",
        "-1.0",
        "range",
    ),
]


@pytest.mark.parametrize("case", case_params(FUSION))
def test_fusion_api_refuses(case: Case) -> None:
    case.check()


def test_fuse_leaves_the_models_unchanged_when_refused() -> None:
    models = [nn.Linear(2, 3), nn.Linear(3, 3)]
    before = [[p.detach().clone() for p in m.parameters()] for m in models]
    with pytest.raises(ValueError):
        fusion.fuse(models)
    for model, saved in zip(models, before, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), saved, strict=True))
