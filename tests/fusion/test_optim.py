"""fusion.optimizer: model k of a fused optimizer trains as the stock optimizer trains it alone.

Tolerance: parameters agree to rtol=1e-4, atol=1e-6 after N steps (float32), not bit for bit.
The fused step runs torch's foreach rules, per model, but where a value differs
between the models (the learning rate here) it multiplies and then adds, where the stock
optimizer adds with ``alpha=value`` in one kernel (``add_(g, alpha=-lr)``): results differ in
the last bits and the difference is carried through the steps.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler

from fusion._stacked import Stacked
from fusion._stacked import batches
from fusion._stacked import fused_loss
from fusion._stacked import make_models
from waterwave_hpo import fusion
from waterwave_hpo.bench import count_ops

RTOL = 1e-4
ATOL = 1e-6
STEPS = 15

SGD_HPARAMS: list[dict[str, Any]] = [
    {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-2},
    {"lr": 0.05},
    {"lr": 0.2, "momentum": 0.5, "dampening": 0.3, "weight_decay": 1e-3},
    {"lr": 0.02, "momentum": 0.8, "maximize": True},
]
ADAM_HPARAMS: list[dict[str, Any]] = [
    {"lr": 1e-2, "betas": (0.8, 0.99), "weight_decay": 1e-2},
    {"lr": 3e-3, "amsgrad": True, "eps": 1e-6},
    {"lr": 5e-3, "betas": (0.95, 0.9), "weight_decay": 0.1, "amsgrad": True},
    {"lr": 1e-3},
]


def _train_stock(
    models: list[nn.Module],
    cls: type[torch.optim.Optimizer],
    hparams: list[dict[str, Any]],
    factories: list[Any] | None,
    steps: int,
    device: str = "cpu",
) -> None:
    opts = [cls(m.parameters(), **hp) for m, hp in zip(models, hparams, strict=True)]
    scheds = [f(o) for f, o in zip(factories, opts, strict=True)] if factories else []
    for step in range(steps):
        xs, ys = (t.to(device) for t in batches(len(models), step))
        for k, (model, opt) in enumerate(zip(models, opts, strict=True)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(xs[k]), ys[k]).backward()
            opt.step()
        for s in scheds:
            s.step()


def _train_fused(
    stacked: Stacked,
    opt: fusion.FusedOptimizer,
    sched: fusion.PerModelScheduler | None,
    steps: range,
    device: str = "cpu",
) -> None:
    for step in steps:
        xs, ys = (t.to(device) for t in batches(stacked.num_models, step))
        opt.zero_grad(set_to_none=True)
        fused_loss(stacked, xs, ys).backward()
        opt.step()
        if sched is not None:
            sched.step()


def _assert_models_equal(stacked: Stacked, models: list[nn.Module]) -> None:
    for k, model in enumerate(models):
        fused = stacked.model_params(k)
        for name, param in model.named_parameters():
            torch.testing.assert_close(fused[name], param.detach(), rtol=RTOL, atol=ATOL)


def _schedules() -> list[Any]:
    return [
        lambda o: lr_scheduler.LambdaLR(o, lambda epoch: 0.9**epoch),
        lambda o: lr_scheduler.StepLR(o, step_size=4, gamma=0.5),
        lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=STEPS + 1),
        lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=STEPS),
    ]


@pytest.mark.parametrize("with_schedule", [False, True])
def test_sgd_models_train_as_with_stock_sgd(with_schedule: bool) -> None:
    stock = make_models(4)
    stacked = Stacked(stock)
    opt = fusion.optimizer(torch.optim.SGD, stacked, SGD_HPARAMS)
    # OneCycleLR also cycles model 2's momentum: the fused optimizer must follow it
    factories = _schedules() if with_schedule else None
    sched = fusion.PerModelScheduler(opt, factories) if factories else None
    _train_stock(stock, torch.optim.SGD, SGD_HPARAMS, factories, STEPS)
    _train_fused(stacked, opt, sched, range(STEPS))
    _assert_models_equal(stacked, stock)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_adam_and_adamw_models_train_as_with_stock_with_their_own_schedules(
    cls: type[torch.optim.Optimizer], device: str
) -> None:
    # on CUDA the stock optimizer takes torch's foreach path: the same tolerance holds
    stock = [m.to(device) for m in make_models(4, seed=1)]
    stacked = Stacked(stock)
    opt = fusion.optimizer(cls, stacked, ADAM_HPARAMS)
    assert opt.param_groups[0]["lr"].device.type == device
    sched = fusion.PerModelScheduler(opt, _schedules())  # OneCycleLR cycles model 2's beta1
    _train_stock(stock, cls, ADAM_HPARAMS, _schedules(), STEPS, device)
    _train_fused(stacked, opt, sched, range(STEPS), device)
    _assert_models_equal(stacked, stock)
    assert sched.get_last_lr() == pytest.approx(
        [0.9**STEPS * 1e-2, 3e-3 * 0.5 ** (STEPS // 4), sched.get_last_lr()[2], 0.0], abs=1e-12
    )


def test_lambda_lr_sets_each_models_lr_from_its_own_function() -> None:
    stacked = Stacked(make_models(3))
    hparams = [{"lr": 0.1}, {"lr": 0.2}, {"lr": 0.4}]
    opt = fusion.optimizer(torch.optim.SGD, stacked, hparams)
    sched = fusion.LambdaLR(opt, [lambda e: 1.0, lambda e: 0.5**e, lambda e: 1.0 / (1 + e)])
    for _ in range(3):
        sched.step()
    assert opt.param_groups[0]["lr"].tolist() == pytest.approx([0.1, 0.2 / 8, 0.4 / 4])
    assert sched.get_last_lr() == pytest.approx([0.1, 0.2 / 8, 0.4 / 4])


def test_reduce_lr_on_plateau_takes_one_metric_per_model() -> None:
    opt = fusion.optimizer(torch.optim.SGD, Stacked(make_models(2)), [{"lr": 1.0}] * 2)
    sched = fusion.PerModelScheduler(
        opt, lambda o: lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5)
    )
    sched.step([1.0, 1.0])
    sched.step([0.5, 2.0])  # model 0 improves, model 1 does not
    assert opt.param_groups[0]["lr"].tolist() == [1.0, 0.5]
    with pytest.raises(ValueError, match=r"metrics=.*K=2"):
        sched.step([1.0])


def test_hyperparameters_are_per_model_tensors() -> None:
    stacked = Stacked(make_models(4))
    opt = fusion.optimizer(torch.optim.AdamW, stacked, ADAM_HPARAMS)
    group = opt.param_groups[0]
    assert opt.num_models == 4
    assert group["lr"].shape == (4,)
    assert group["betas"].shape == (4, 2)
    assert group["amsgrad"].tolist() == [False, True, True, False]
    assert opt.hparams(0)["betas"] == (0.8, 0.99)
    assert opt.hparams(3)["weight_decay"] == 1e-2  # AdamW's default, not Adam's
    assert isinstance(opt, torch.optim.Optimizer)


def test_parameters_with_num_models_or_inferred_work_like_the_module() -> None:
    stock = make_models(2)
    a, b = Stacked(stock), Stacked(stock)
    hp = [{"lr": 0.1}, {"lr": 0.3}]
    opt_a = fusion.optimizer(torch.optim.SGD, a.parameters(), hp, num_models=2)
    opt_b = fusion.optimizer(torch.optim.SGD, b.parameters(), hp)  # K from the leading dims
    _train_fused(a, opt_a, None, range(3))
    _train_fused(b, opt_b, None, range(3))
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.AdamW])
def test_state_dict_round_trip_continues_training_exactly(
    cls: type[torch.optim.Optimizer],
) -> None:
    hparams = SGD_HPARAMS if cls is torch.optim.SGD else ADAM_HPARAMS
    first = Stacked(make_models(4))
    opt = fusion.optimizer(cls, first, hparams)
    sched = fusion.PerModelScheduler(opt, lambda o: lr_scheduler.StepLR(o, step_size=2))
    _train_fused(first, opt, sched, range(3))
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()

    second = Stacked(make_models(4, seed=7))  # other weights; load the first's
    second.load_state_dict(first.state_dict())
    opt2 = fusion.optimizer(cls, second, [{"lr": 9.0}] * 4)  # overwritten by the load
    sched2 = fusion.PerModelScheduler(opt2, lambda o: lr_scheduler.StepLR(o, step_size=2))
    opt2.load_state_dict(saved_opt)
    sched2.load_state_dict(saved_sched)
    assert opt2.hparams(0) == opt.hparams(0)

    _train_fused(first, opt, sched, range(3, 7))
    _train_fused(second, opt2, sched2, range(3, 7))
    for p1, p2 in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(p1, p2)


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam])
def test_keep_models_continues_the_kept_models_as_stock_would(
    cls: type[torch.optim.Optimizer],
) -> None:
    hparams = SGD_HPARAMS if cls is torch.optim.SGD else ADAM_HPARAMS
    stock = make_models(4, seed=2)
    stacked = Stacked(stock)
    opt = fusion.optimizer(cls, stacked, hparams)
    sched = fusion.PerModelScheduler(opt, _schedules())
    _train_fused(stacked, opt, sched, range(5))
    kept = [2, 0]
    stacked.keep(kept)
    opt.keep_models(kept)  # also drops models 1 and 3's schedulers
    assert opt.num_models == 2
    assert opt.param_groups[0]["lr"].shape == (2,)
    _train_fused(stacked, opt, sched, range(5, 10))

    # the stock run: models 2 and 0 with their batches of K=4 for 5 steps, then of K'=2
    opts = [cls(m.parameters(), **hp) for m, hp in zip(stock, hparams, strict=True)]
    scheds = [f(o) for f, o in zip(_schedules(), opts, strict=True)]
    for step in range(10):
        order = list(range(4)) if step < 5 else kept
        xs, ys = batches(len(order), step)
        for j, k in enumerate(order):
            opts[k].zero_grad()
            nn.functional.cross_entropy(stock[k](xs[j]), ys[j]).backward()
            opts[k].step()
            scheds[k].step()
    _assert_models_equal(stacked, [stock[k] for k in kept])


# ---- bad input -------------------------------------------------------------------------------


def test_hyperparameter_list_of_the_wrong_length_names_k_and_the_length() -> None:
    with pytest.raises(ValueError, match=r"hparams=.*has 3 entries but there are K=4 models"):
        fusion.optimizer(torch.optim.SGD, Stacked(make_models(4)), [{"lr": 0.1}] * 3)


def test_unsupported_optimizer_class_names_the_supported_ones() -> None:
    with pytest.raises(
        ValueError,
        match=r"cls=.*RMSprop.*torch\.optim\.SGD, torch\.optim\.Adam, torch\.optim\.AdamW",
    ):
        fusion.optimizer(torch.optim.RMSprop, Stacked(make_models(2)), [{}] * 2)
    with pytest.raises(TypeError, match=r"cls='sgd': must be an optimizer class"):
        fusion.optimizer("sgd", Stacked(make_models(2)), [{}] * 2)  # type: ignore[arg-type]


def test_unknown_hyperparameter_names_it_and_the_supported_ones() -> None:
    with pytest.raises(
        ValueError,
        match=r"hparams\[1\]=.*'betas'.*fused SGD.*lr, momentum, dampening, weight_decay",
    ):
        fusion.optimizer(
            torch.optim.SGD, Stacked(make_models(2)), [{"lr": 0.1}, {"betas": (0.9, 0.9)}]
        )


@pytest.mark.parametrize(
    ("bad", "pattern"),
    [
        ({"lr": "0.1"}, r"hparams\[1\]\['lr'\]='0.1': must be a real number"),
        ({"lr": torch.tensor(0.1)}, r"hparams\[1\]\['lr'\]=.*must be a real number"),
        ({"amsgrad": 1}, r"hparams\[1\]\['amsgrad'\]=1: must be a bool"),
        ({"betas": 0.9}, r"hparams\[1\]\['betas'\]=0.9: must be a pair of numbers"),
    ],
)
def test_non_numeric_hyperparameter_is_a_type_error_naming_model_and_name(
    bad: dict[str, Any], pattern: str
) -> None:
    with pytest.raises(TypeError, match=pattern):
        fusion.optimizer(torch.optim.Adam, Stacked(make_models(2)), [{}, bad])


@pytest.mark.parametrize(
    ("bad", "pattern"),
    [
        ({"lr": -0.1}, r"hparams\[0\]=\{'lr': -0.1\}: torch.optim.SGD refuses it"),
        ({"nesterov": True}, r"hparams\[0\]=.*Nesterov"),
        ({"lr": math.nan}, r"hparams\[0\]\['lr'\]=nan: must be finite"),
    ],
)
def test_values_the_stock_optimizer_refuses_are_refused_naming_the_model(
    bad: dict[str, Any], pattern: str
) -> None:
    with pytest.raises(ValueError, match=pattern):
        fusion.optimizer(torch.optim.SGD, Stacked(make_models(2)), [bad, {}])


def test_parameters_without_the_leading_k_dim_are_refused_naming_them() -> None:
    model = nn.Linear(3, 2)  # weight (2, 3): leading dim 2, but bias (2,) too; K=4 wanted
    with pytest.raises(ValueError, match=r"weight=.*shape \(2, 3\).*no leading dim of size K=4"):
        fusion.optimizer(torch.optim.SGD, model, [{}] * 4, num_models=4)
    with pytest.raises(ValueError, match=r"num_models=None: cannot be inferred"):
        fusion.optimizer(torch.optim.SGD, [torch.zeros(2, 3), torch.zeros(3)], [{}] * 2)
    with pytest.raises(ValueError, match=r"num_models=3: disagrees with the module's"):
        fusion.optimizer(torch.optim.SGD, Stacked(make_models(2)), [{}] * 3, num_models=3)


def test_step_after_parameters_were_restacked_alone_says_to_call_keep_models() -> None:
    stacked = Stacked(make_models(3))
    opt = fusion.optimizer(torch.optim.SGD, stacked, [{"lr": 0.1}] * 3)
    stacked.keep([0, 1])
    stacked(torch.zeros(2, 1, 8)).sum().backward()
    with pytest.raises(ValueError, match=r"K=3.*keep_models on both"):
        opt.step()


@pytest.mark.parametrize(
    ("indices", "error", "pattern"),
    [
        ([], ValueError, r"indices=\[\]: is empty"),
        ([0, 3], ValueError, r"out of range for K=3"),
        ([1, 1], ValueError, r"repeats an index"),
        ("01", TypeError, r"indices='01': must be a sequence of ints"),
    ],
)
def test_keep_models_refuses_bad_indices(
    indices: Any, error: type[Exception], pattern: str
) -> None:
    opt = fusion.optimizer(torch.optim.SGD, Stacked(make_models(3)), [{"lr": 0.1}] * 3)
    with pytest.raises(error, match=pattern):
        opt.keep_models(indices)
    assert opt.num_models == 3


def test_schedule_lists_of_the_wrong_length_name_k() -> None:
    opt = fusion.optimizer(torch.optim.SGD, Stacked(make_models(3)), [{"lr": 0.1}] * 3)
    with pytest.raises(ValueError, match=r"lr_lambdas=.*2 entries but there are K=3"):
        fusion.LambdaLR(opt, [lambda e: 1.0] * 2)
    with pytest.raises(TypeError, match=r"schedulers\[0\]=.*returns a torch.optim.lr_scheduler"):
        fusion.PerModelScheduler(opt, lambda o: 0.5)  # type: ignore[arg-type,return-value]


def test_a_saved_state_dict_keeps_its_values_when_the_schedule_moves_on() -> None:
    opt = fusion.optimizer(torch.optim.SGD, Stacked(make_models(2)), [{"lr": 1.0}] * 2)
    sched = fusion.LambdaLR(opt, [lambda e: 0.5**e] * 2)
    saved = opt.state_dict()
    sched.step()
    assert saved["param_groups"][0]["lr"].tolist() == [1.0, 1.0]
    assert opt.param_groups[0]["lr"].tolist() == [0.5, 0.5]


def test_a_schedule_overrides_a_hand_set_value_on_its_next_step_as_stock_does() -> None:
    opt = fusion.optimizer(torch.optim.SGD, Stacked(make_models(2)), [{"lr": 0.1}] * 2)
    sched = fusion.LambdaLR(opt, [lambda e: 1.0, lambda e: 0.5])
    opt.set_hparam("lr", [7.0, 7.0])
    sched.step()
    assert opt.param_groups[0]["lr"].tolist() == [0.1, 0.05]


def test_numpy_scalars_are_numbers_and_integer_parameters_are_refused() -> None:
    import numpy as np

    opt = fusion.optimizer(
        torch.optim.SGD, Stacked(make_models(2)), [{"lr": np.float32(0.5)}, {"lr": 1}]
    )
    assert opt.param_groups[0]["lr"].tolist() == [0.5, 1.0]
    with pytest.raises(ValueError, match=r"parameter 0=.*torch.int64.*floating-point"):
        fusion.optimizer(torch.optim.SGD, [torch.zeros(2, 3, dtype=torch.long)], [{}] * 2)


def test_a_second_parameter_group_is_refused() -> None:
    opt = fusion.optimizer(torch.optim.SGD, Stacked(make_models(2)), [{"lr": 0.1}] * 2)
    with pytest.raises(ValueError, match=r"param_group=.*one group.*one fusion.optimizer"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2, 3))]})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.AdamW])
def test_a_nan_gradient_in_one_model_touches_no_other(cls: type[torch.optim.Optimizer]) -> None:
    hparams = SGD_HPARAMS if cls is torch.optim.SGD else ADAM_HPARAMS
    runs = []
    for poison in (False, True):
        stacked = Stacked(make_models(4))
        opt = fusion.optimizer(cls, stacked, hparams)
        for step in range(3):
            xs, ys = batches(4, step)
            opt.zero_grad()
            fused_loss(stacked, xs, ys).backward()
            if poison:
                for p in stacked.parameters():
                    p.grad[1] = math.nan  # type: ignore[index]
            opt.step()
        runs.append(stacked)
    clean, poisoned = runs
    for k in (0, 2, 3):
        for name, value in poisoned.model_params(k).items():
            assert torch.equal(value, clean.model_params(k)[name]), (k, name)
    assert all(v.isnan().all() for v in poisoned.model_params(1).values())


def test_schedules_composed_inside_the_factory_follow_stock() -> None:
    def warmup_then_decay(o: torch.optim.Optimizer) -> lr_scheduler.LRScheduler:
        warmup = lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3)
        decay = lr_scheduler.ExponentialLR(o, gamma=0.5)
        return lr_scheduler.SequentialLR(o, [warmup, decay], milestones=[3])

    opt = fusion.optimizer(torch.optim.SGD, Stacked(make_models(2)), [{"lr": 1.0}, {"lr": 0.1}])
    sched = fusion.PerModelScheduler(opt, warmup_then_decay)
    stock = [torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr) for lr in (1.0, 0.1)]
    stock_scheds = [warmup_then_decay(o) for o in stock]
    for _ in range(6):
        sched.step()
        for o, s in zip(stock, stock_scheds, strict=True):
            o.step()
            s.step()
        assert opt.param_groups[0]["lr"].tolist() == [o.param_groups[0]["lr"] for o in stock]


def test_a_scheduler_step_queues_the_new_values_without_a_blocking_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each step's (K,) values reach the device by one queued copy from
    pinned memory per changed hyperparameter, never a copy the host waits for."""
    from fusion._copies import HostToDeviceCopies

    stacked = Stacked(make_models(3))
    opt = fusion.optimizer(torch.optim.SGD, stacked, [{"lr": 0.1, "momentum": 0.9}] * 3)
    sched = fusion.LambdaLR(opt, [lambda e: 1.0, lambda e: 0.5**e, lambda e: 1.0 / (1 + e)])
    group = opt.param_groups[0]
    for name in ("lr", "momentum", "weight_decay", "dampening"):
        group[name] = group[name].to("meta")  # the values live on the (stand-in) device
    copies = HostToDeviceCopies(monkeypatch)
    with copies:
        for _ in range(4):
            sched.step()
    assert copies.blocking == []
    assert len(copies.copies) == 4  # lr, once per step; the other values did not change
    assert group["lr"].device.type == "meta"


def test_hparams_follow_a_group_value_replaced_by_hand() -> None:
    # The host keeps copies of the per-model values (a step never reads them back from the
    # device); a tensor put into param_groups by hand is read once instead of the stale copy.
    weight = nn.Parameter(torch.zeros(2, 3))
    opt = fusion.optimizer(torch.optim.SGD, [weight], [{"lr": 0.1}, {"lr": 0.2}])
    opt.param_groups[0]["weight_decay"] = torch.tensor([0.0, 0.5], dtype=torch.float64)
    assert opt.hparams(1)["weight_decay"] == 0.5
    opt.set_hparam("momentum", [0.9, 0.0])
    assert opt.hparams(0)["momentum"] == 0.9


# ---- operations per step -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "hparams"),
    [
        (torch.optim.SGD, [{"lr": 0.1, "momentum": 0.9}, {"lr": 0.2, "momentum": 0.5}]),
        (torch.optim.AdamW, [{"lr": 1e-3, "amsgrad": True}, {"lr": 1e-2, "weight_decay": 0.1}]),
    ],
    ids=["sgd", "adamw"],
)
def test_a_step_runs_the_same_kernels_whatever_the_number_of_parameters(
    cls: type[torch.optim.Optimizer], hparams: list[dict[str, Any]]
) -> None:
    """A fused step is a fixed few foreach operations over all the parameters (or the models'
    slices of them), not a sequence of operations per parameter (each a kernel launch on a
    GPU)."""

    def kernels_per_step(num_params: int) -> int:
        gen = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(2, 3, 4, generator=gen)) for _ in range(num_params)]
        opt = fusion.optimizer(cls, params, hparams)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()  # the first step creates the state
        return count_ops(opt.step).compute  # views (a gradient's K slices) launch no kernel

    few, many = kernels_per_step(2), kernels_per_step(12)
    assert few == many, (few, many)


def test_a_value_written_in_place_by_hand_is_used_at_the_next_step() -> None:
    # The step reads the values from their host copies; a write by hand into the group's
    # tensor is seen (read back once), as when the step read the tensor itself.
    weight = nn.Parameter(torch.ones(2, 3))
    opt = fusion.optimizer(torch.optim.SGD, [weight], [{"lr": 1.0}, {"lr": 1.0}])
    opt.param_groups[0]["lr"].mul_(0.5)
    weight.grad = torch.ones(2, 3)
    opt.step()
    torch.testing.assert_close(weight.detach(), torch.full((2, 3), 0.5))
    assert opt.hparams(1)["lr"] == 0.5


def test_a_model_whose_momentum_starts_later_starts_its_buffer_as_stock_does() -> None:
    # Stock SGD makes a parameter's momentum buffer at the first step with momentum != 0 (a
    # copy of that step's gradient); a model that had momentum 0 until then must too, even
    # though the fused buffer already exists for the others.
    stock = make_models(2, seed=3)
    stacked = Stacked(stock)
    hparams: list[dict[str, Any]] = [{"lr": 0.1, "momentum": 0.9}, {"lr": 0.1, "momentum": 0.0}]
    opt = fusion.optimizer(torch.optim.SGD, stacked, hparams)
    opts = [torch.optim.SGD(m.parameters(), **hp) for m, hp in zip(stock, hparams, strict=True)]
    for step in range(6):
        if step == 3:
            opt.set_hparam("momentum", [0.9, 0.8])
            opts[1].param_groups[0]["momentum"] = 0.8
        _train_fused(stacked, opt, None, range(step, step + 1))
        xs, ys = batches(2, step)
        for k, (model, o) in enumerate(zip(stock, opts, strict=True)):
            o.zero_grad()
            nn.functional.cross_entropy(model(xs[k]), ys[k]).backward()
            o.step()
    _assert_models_equal(stacked, stock)


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.AdamW])
def test_values_the_models_share_run_over_the_stacked_parameters_not_their_slices(
    cls: type[torch.optim.Optimizer],
) -> None:
    """An operation whose value every model shares runs once over the N stacked tensors
    (about one kernel launch on a GPU, as for one model's foreach step), not over the K*N
    slices (a few launches); only values that differ take the slices."""
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(3, 4, 5, generator=gen)) for _ in range(4)]
    hparams = [{"lr": 1e-2, "momentum": 0.9} if cls is torch.optim.SGD else {"lr": 1e-3}] * 3
    opt = fusion.optimizer(cls, params, hparams)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()  # the first step creates the state
    shared = count_ops(opt.step).by_op
    assert "aten.unbind.int" not in shared, shared  # no slices made
    assert not any("ScalarList" in op for op in shared), shared  # one value per operation
    opt.set_hparam("lr", [1e-2, 2e-2, 3e-2])
    per_model = count_ops(opt.step).by_op
    assert any("ScalarList" in op for op in per_model), per_model  # the learning rates
