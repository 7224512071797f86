"""pipeline() and node_groups(): profiling, cuts, groups that cover the model once."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from waterwave_hpo.bench import BasicBlock
from waterwave_hpo.nodegroup import node_groups
from waterwave_hpo.nodegroup import pipeline
from waterwave_hpo.nodegroup import trial_profile

from ._zoo import MODELS
from ._zoo import batch_for
from ._zoo import build
from ._zoo import loss_of


def called_leaves(model: nn.Module, x: torch.Tensor) -> list[str]:
    """Names of the leaf modules a forward calls, in call order (each once)."""
    names = {id(m): n for n, m in model.named_modules()}
    order: list[str] = []
    hooks = [
        m.register_forward_pre_hook(lambda mod, args: order.append(names[id(mod)]))
        for m in model.modules()
        if not list(m.children())
    ]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return list(dict.fromkeys(order))


def leaves_under(model: nn.Module, name: str) -> list[str]:
    prefix = f"{name}." if name else ""
    return [
        n
        for n, m in model.named_modules()
        if not list(m.children()) and (n == name or n.startswith(prefix))
    ]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("k", [1, 2, 4, "auto"])
def test_groups_are_contiguous_and_cover_each_called_module_once(name: str, k: object) -> None:
    torch.manual_seed(0)
    model = build(name)
    x, y = batch_for(name)
    pipeline(model, groups=k)  # type: ignore[arg-type]
    loss_of(name, model(x), y).backward()  # the profiled step
    groups = node_groups(model)
    if isinstance(k, int):
        assert 1 <= len(groups) <= k
    assert [g.index for g in groups] == list(range(len(groups)))
    covered = [leaf for g in groups for m in g.modules for leaf in leaves_under(model, m)]
    group_of = {leaf: g.index for g in groups for m in g.modules for leaf in leaves_under(model, m)}
    expected = called_leaves(model, x)
    assert sorted(covered) == sorted(set(covered)), "a module is in two groups"
    assert set(expected) <= set(covered), "a called module is in no group"
    in_call_order = [group_of[leaf] for leaf in expected]
    assert in_call_order == sorted(in_call_order), "groups are not contiguous in call order"
    assert set(in_call_order) == set(range(len(groups))), "a group holds no module"
    assert all(g.saved_bytes >= 0 and g.forward_s >= 0 and g.backward_s >= 0 for g in groups)


@pytest.mark.parametrize("name", MODELS)
def test_saved_bytes_add_up_to_what_autograd_saves(name: str) -> None:
    torch.manual_seed(0)
    model = build(name)
    x, _ = batch_for(name)
    seen: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen.setdefault(s.data_ptr(), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    pipeline(model, groups=3, example_input=x)
    assert sum(g.saved_bytes for g in node_groups(model)) == sum(seen.values())


@pytest.mark.filterwarnings("ignore:pipeline\\(groups=.*more groups than:UserWarning")
def test_residual_blocks_stay_whole_and_are_cut_between() -> None:
    model = build("resnet")
    pipeline(model, groups=16, example_input=batch_for("resnet")[0])
    names = [m for g in node_groups(model) for m in g.modules]
    assert "blocks.0" in names and "blocks.2" in names
    assert not any(n.startswith("blocks.0.") for n in names), names


@pytest.mark.filterwarnings("ignore:pipeline\\(groups=.*more groups than:UserWarning")
def test_a_residual_block_after_a_stem_is_one_group() -> None:
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), BasicBlock(4))
    pipeline(model, groups=8, example_input=torch.randn(2, 3, 6, 6))
    assert [g.modules for g in node_groups(model)] == [("0",), ("1",)]


@pytest.mark.filterwarnings("ignore:pipeline\\(groups=.*more groups than:UserWarning")
def test_no_cut_where_a_second_tensor_crosses() -> None:
    class TwoTower(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.c(self.b(h)) + h  # h crosses the boundary between b and c

    model = TwoTower()
    pipeline(model, groups=3, example_input=torch.randn(2, 4, requires_grad=True))
    groups = node_groups(model)
    assert [g.modules for g in groups] == [("a",), ("b", "c")]


@pytest.mark.filterwarnings("ignore:pipeline\\(groups=.*more groups than:UserWarning")
def test_transformer_is_cut_at_the_residual_sums() -> None:
    model = build("gpt")
    pipeline(model, groups=16, example_input=batch_for("gpt")[0])
    starts = [g.modules[0] for g in node_groups(model)]
    assert "blocks.0.ln2" in starts  # after x = x + attn(ln1(x)): one tensor crosses
    assert not any(s.startswith("blocks.0.attn.") for s in starts)


def test_example_input_changes_no_state() -> None:
    torch.manual_seed(0)
    model = build("cnn")
    x, _ = batch_for("cnn")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    pipeline(model, example_input=x)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng, torch.random.get_rng_state())


def test_profile_and_resident_bytes() -> None:
    model = build("mlp")
    pipeline(model, groups=2, example_input=batch_for("mlp")[0])
    profile = trial_profile(model)
    n_param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert profile.resident_bytes == 2 * n_param_bytes
    assert profile.group_bytes == tuple(g.saved_bytes for g in node_groups(model))
    assert sum(g.param_bytes for g in node_groups(model)) == n_param_bytes


def test_node_groups_errors() -> None:
    model = build("mlp")
    with pytest.raises(ValueError, match=r"call waterwave_hpo.pipeline\(model\) first"):
        node_groups(model)
    pipeline(model)
    with pytest.raises(RuntimeError, match="not profiled yet"):
        node_groups(model)
    with torch.no_grad():  # an inference forward does not profile
        model(batch_for("mlp")[0])
    with pytest.raises(RuntimeError, match="not profiled yet"):
        node_groups(model)


@pytest.mark.parametrize(
    ("groups", "error"),
    [(0, ValueError), (-2, ValueError), ("many", TypeError), (2.0, TypeError), (True, TypeError)],
)
def test_bad_groups_argument(groups: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=rf"^groups={groups!r}: must be "):
        pipeline(build("mlp"), groups=groups)  # type: ignore[arg-type]


def test_not_a_module() -> None:
    with pytest.raises(TypeError, match=r"must be a torch\.nn\.Module"):
        pipeline(lambda x: x)  # type: ignore[arg-type]


def test_too_many_groups_warns_and_caps() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.warns(UserWarning, match="more groups than the model has valid cut points"):
        pipeline(model, groups=50, example_input=torch.randn(3, 4))
    assert 1 <= len(node_groups(model)) <= 3


def test_frozen_model_falls_back_to_sequential_cuts() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    for p in model.parameters():
        p.requires_grad_(False)
    pipeline(model, groups=4)
    out = model(torch.randn(3, 4))  # grad enabled, but no autograd graph at all
    assert out.grad_fn is None
    assert [g.modules for g in node_groups(model)] == [("0",), ("1",), ("2.0",), ("2.1",)]


def test_profiling_rewinds_no_other_devices_random_state(monkeypatch: pytest.MonkeyPatch) -> None:
    # Co-hosted trials on other GPUs draw from their devices' generators while this model
    # profiles; rewinding them would replay their random numbers. A CPU model touches none.
    touched: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: touched.append("get all") or [])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: touched.append("set all"))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda d=0: touched.append(f"get {d}"))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, d=0: touched.append(f"set {d}"))
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    before = torch.random.get_rng_state()
    pipeline(model, example_input=x)
    assert touched == []
    assert torch.equal(torch.random.get_rng_state(), before)  # the CPU generator is rewound


def test_a_refused_example_input_leaves_no_profiler_hooks_on_the_thread() -> None:
    """The profiler pushes saved-tensor hooks when the profiled forward starts; a forward that
    raises (a batch of the wrong shape) must not leave them on the caller's thread, where every
    later backward would pack through them (torch.func refuses to run under such hooks)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match="example_input"):
        pipeline(model, example_input=torch.randn(3, 7))
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    with pytest.raises(ValueError, match="pipeline"):
        node_groups(model)  # no half-profiled pipeline is left on the model
    x = torch.randn(3, 4, requires_grad=True)
    torch.func.vjp(lambda t: model(t).square().sum(), x)  # raises under leftover hooks


def test_a_gated_model_is_freed_once_its_trial_drops_it() -> None:
    # A trial's model (on a GPU: its parameters in device memory) must not outlive the trial
    # because ww.pipeline registered it: the registry keeps models weakly.
    model = pipeline(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    for _ in range(2):  # the first step profiles, the second runs through the gates
        model(torch.randn(4, 8)).sum().backward()
    alive = [weakref.ref(model), *(weakref.ref(p) for p in model.parameters())]
    del model
    gc.collect()
    assert [r() is None for r in alive] == [True] * len(alive)
