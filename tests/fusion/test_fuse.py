"""fusion.fuse / FusedModule: the K fused models behave as the K models trained alone."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from waterwave_hpo import fusion

# Float32 tolerance: a fused layer sums the same products as the separate one but in another
# order (batched matmul / grouped convolution kernels block differently), so results agree to
# rounding, not bit for bit.
TOL = {"rtol": 1e-5, "atol": 1e-5}


def mlp(seed: int, p: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Dropout(p), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


def bn_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 5 * 5, 8),
        nn.BatchNorm1d(8),
        nn.Linear(8, 3),
    )


class Custom(nn.Module):
    """A user's own module class: its forward runs unchanged under fusion."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)
        self.body = nn.ModuleList([nn.Linear(8, 8), nn.GELU()])
        self.head = nn.Conv1d(8, 2, 3, padding=1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(tokens))
        for layer in self.body:
            h = layer(h)
        return self.head(h.transpose(1, 2)).mean(-1)


@pytest.mark.parametrize("kernels", [True, False])
def test_fused_forward_and_gradients_equal_separate_models(kernels: bool) -> None:
    models = [mlp(seed) for seed in range(3)]
    fused = fusion.fuse(models, kernels=kernels)
    x = torch.randn(5, 16)
    target = torch.tensor([0, 1, 2, 3, 0])
    out = fused(x)
    assert out.shape == (3, 5, 4)
    fusion.per_model_loss(F.cross_entropy, out, target).sum().backward()
    for k, model in enumerate(models):
        torch.testing.assert_close(out[k], model(x), **TOL)
        F.cross_entropy(model(x), target).backward()
        for (name, p), q in zip(model.named_parameters(), fused.parameters(), strict=True):
            assert q.shape == (3, *p.shape), name
            assert q.grad is not None
            torch.testing.assert_close(q.grad[k], p.grad, **TOL)


@pytest.mark.parametrize("kernels", [True, False])
def test_stacked_inputs_give_each_model_its_own_batch(kernels: bool) -> None:
    models = [bn_net(seed) for seed in range(2)]
    fused = fusion.fuse(models, kernels=kernels)
    xs = torch.randn(2, 4, 3, 5, 5)
    out = fused(xs, stacked=True)
    for k, model in enumerate(models):
        torch.testing.assert_close(out[k], model(xs[k]), **TOL)
    with pytest.raises(
        ValueError, match=r"inputs\[0\]\.shape=\(3, 4, 3, 5, 5\): must start with K=2"
    ):
        fused(torch.randn(3, 4, 3, 5, 5), stacked=True)


def test_a_users_own_module_class_fuses_unchanged() -> None:
    torch.manual_seed(0)
    models = [Custom() for _ in range(3)]
    fused = fusion.fuse(models)
    tokens = torch.randint(0, 10, (4, 6))
    out = fused(tokens)
    out.square().sum().backward()
    for k, model in enumerate(models):
        ref = model(tokens)
        torch.testing.assert_close(out[k], ref, **TOL)
        ref.square().sum().backward()
        for p, q in zip(model.parameters(), fused.parameters(), strict=True):
            assert q.grad is not None and p.grad is not None
            torch.testing.assert_close(q.grad[k], p.grad, **TOL)


def test_batchnorm_keeps_running_statistics_per_model_in_train_and_eval() -> None:
    models = [bn_net(seed) for seed in range(3)]
    fused = fusion.fuse(models)
    for step in range(3):
        x = torch.randn(4, 3, 5, 5) * (step + 1)
        out = fused(x)
        for k, model in enumerate(models):
            torch.testing.assert_close(out[k], model(x), **TOL)
    for k, model in enumerate(models):
        torch.testing.assert_close(fused.stacked[1].running_mean[k], model[1].running_mean)
        torch.testing.assert_close(fused.stacked[5].running_var[k], model[5].running_var)
        assert int(fused.stacked[1].num_batches_tracked[k]) == 3
    assert not torch.equal(fused.stacked[1].running_mean[0], fused.stacked[1].running_mean[1])
    fused.eval()
    x = torch.randn(4, 3, 5, 5)
    out = fused(x)
    for k, model in enumerate(models):
        torch.testing.assert_close(out[k], model.eval()(x), **TOL)


class Wrap(nn.Module):
    """A user's module: not a Sequential, so its forward runs under vmap."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("wrap", [False, True], ids=["sequential", "under_vmap"])
def test_each_model_keeps_its_own_dropout_rate(wrap: bool) -> None:
    rates = [0.0, 0.5, 0.9]
    models = [nn.Sequential(nn.Identity(), nn.Dropout(p)) for p in rates]
    fused = fusion.fuse([Wrap(m) if wrap else m for m in models])
    out = fused(torch.ones(200, 100))
    for k, p in enumerate(rates):
        dropped = (out[k] == 0).float().mean().item()
        assert abs(dropped - p) < 0.02, (p, dropped)
        kept = out[k][out[k] != 0]
        torch.testing.assert_close(kept, torch.full_like(kept, 1 / (1 - p)))
    fused.eval()
    torch.testing.assert_close(fused(torch.ones(3, 4)), torch.ones(3, 3, 4))


@pytest.mark.parametrize("wrap", [False, True], ids=["sequential", "under_vmap"])
def test_models_with_the_same_rate_draw_independent_masks(wrap: bool) -> None:
    models = [nn.Sequential(nn.Dropout(0.5)) for _ in range(4)]
    fused = fusion.fuse([Wrap(m) if wrap else m for m in models])
    out = fused(torch.ones(64, 64))
    masks = (out != 0).flatten(1)
    for a in range(4):
        for b in range(a + 1, 4):
            agree = (masks[a] == masks[b]).float().mean().item()
            assert 0.4 < agree < 0.6  # independent: half agree; the same mask: all


def train_steps(
    model: nn.Module, xs: list[torch.Tensor], ys: list[torch.Tensor], lr: float
) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in zip(xs, ys, strict=True):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def test_unfuse_returns_the_trained_models_with_their_own_state() -> None:
    models = [bn_net(seed) for seed in range(3)]
    originals = copy.deepcopy(models)
    fused = fusion.fuse(models)
    xs = [torch.randn(4, 3, 5, 5) for _ in range(3)]
    ys = [torch.randint(0, 3, (4,)) for _ in range(3)]
    opt = torch.optim.SGD(fused.parameters(), lr=0.1)
    for x, y in zip(xs, ys, strict=True):
        opt.zero_grad()
        fusion.per_model_loss(F.cross_entropy, fused(x), y).sum().backward()
        opt.step()
    for model in models:
        train_steps(model, xs, ys, lr=0.1)
    unfused = fused.unfuse()
    assert len(unfused) == 3
    for k, (mine, ref, orig) in enumerate(zip(unfused, models, originals, strict=True)):
        assert type(mine) is nn.Sequential and type(mine[1]) is nn.BatchNorm2d
        for (name, a), b in zip(mine.state_dict().items(), ref.state_dict().values(), strict=True):
            torch.testing.assert_close(a, b, **TOL, msg=f"model {k}: {name}")
        assert not torch.equal(mine[0].weight, orig[0].weight)  # trained, not the start
        assert mine.training
    # The fused module is unchanged by unfuse and the unfused models are independent of it.
    unfused[0][0].weight.data.zero_()
    assert fused.stacked[0].weight[0].abs().sum() > 0


def test_unfuse_gives_each_model_back_its_dropout_rate() -> None:
    fused = fusion.fuse([mlp(0, p=0.1), mlp(1, p=0.3), mlp(2, p=0.7)])
    fused.keep_models([2, 0])
    ps = [model[2].p for model in fused.unfuse()]
    assert ps == [0.7, 0.1]
    assert all(type(model[2]) is nn.Dropout for model in fused.unfuse())


def test_keep_models_restacks_in_place_and_keeps_parameter_identity() -> None:
    models = [bn_net(seed) for seed in range(4)]
    fused = fusion.fuse(models)
    x = torch.randn(4, 3, 5, 5)
    fusion.per_model_loss(F.cross_entropy, fused(x), torch.tensor([0, 1, 2, 0])).sum().backward()
    params = list(fused.parameters())
    grads = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    for model in models:
        model(x)  # the same running-statistics update the fused train step made
    fused.keep_models([3, 1])
    assert fused.num_models == 2
    for p, g, q in zip(params, grads, fused.parameters(), strict=True):
        assert p is q
        assert p.shape[0] == 2 and p.grad is not None
        torch.testing.assert_close(p.grad, g[[3, 1]])
    assert fused.stacked[1].running_mean.shape == (2, 6)
    fused.eval()
    out = fused(x)
    assert out.shape == (2, 4, 3)
    torch.testing.assert_close(out[0], models[3].eval()(x), **TOL)
    torch.testing.assert_close(out[1], models[1].eval()(x), **TOL)


@pytest.mark.parametrize("kernels", [True, False])
def test_training_goes_on_after_keep_models_while_the_last_graph_is_alive(kernels: bool) -> None:
    # A training loop's `loss` outlives the step in which a trial is pruned: the next backward
    # must see the kept models' shapes, not the old K (autograd caches a node per parameter).
    models = [bn_net(seed) for seed in range(4)]
    fused = fusion.fuse(models, kernels=kernels)
    opt = fusion.optimizer(torch.optim.SGD, fused, [{"lr": 0.1, "momentum": 0.9}] * 4)
    x, y = torch.randn(4, 3, 5, 5), torch.tensor([0, 1, 2, 0])
    loss = fusion.per_model_loss(F.cross_entropy, fused(x), y).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    fused.keep_models([2, 0])
    opt.keep_models([2, 0])
    assert loss.grad_fn is not None  # the earlier step's graph is still alive
    fusion.per_model_loss(F.cross_entropy, fused(x), y).sum().backward()
    opt.step()
    assert [p.shape[0] for p in fused.parameters()] == [2] * len(list(fused.parameters()))
    assert all(p.grad is not None and p.grad.shape == p.shape for p in fused.parameters())


@pytest.mark.parametrize(
    ("indices", "error", "match"),
    [
        (
            [],
            ValueError,
            r"indices=\[\]: must be distinct and non-empty; pass distinct positions in range\(3\)",
        ),
        ([0, 0], ValueError, "must be distinct"),
        ([3], ValueError, r"must lie in range\(3\)"),
        ([-1], ValueError, r"must lie in range\(3\)"),
        ("01", TypeError, "must be a sequence of ints"),
        ([0.0], TypeError, "must be a sequence of ints"),
    ],
)
def test_keep_models_rejects_bad_indices(indices: object, error: type, match: str) -> None:
    fused = fusion.fuse([mlp(seed) for seed in range(3)])
    with pytest.raises(error, match=match):
        fused.keep_models(indices)  # type: ignore[arg-type]
    assert fused.num_models == 3


def test_fuse_rejects_no_models_and_non_models() -> None:
    with pytest.raises(ValueError, match=r"models=\[\]: must hold at least one model \(K >= 1\)"):
        fusion.fuse([])
    with pytest.raises(TypeError, match=r"models=Linear.*must be a sequence of nn.Module"):
        fusion.fuse(nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"models\[1\]='x': must be an nn.Module, not str"):
        fusion.fuse([nn.Linear(2, 2), "x"])  # type: ignore[list-item]


def test_fuse_names_the_first_structural_difference() -> None:
    a = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    b = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with pytest.raises(
        ValueError,
        match=r"models\[2\]=<Sequential>: differs from models\[0\] in structure: "
        r"module '2'.*out_features=2.*out_features=3",
    ):
        fusion.fuse([a, a, b])
    with pytest.raises(
        ValueError, match=r"'0.weight': parameter \(8, 4\) torch.float32 .*vs .*torch.float64"
    ):
        fusion.fuse([a, copy.deepcopy(a).double()])


def test_fuse_refuses_unsupported_layers_by_path() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.LSTM(4, 4)))
    with pytest.raises(
        TypeError,
        match=r"models\[0\]\.1\.1=<LSTM>: torch.nn.modules.rnn.LSTM is not supported: torch has ",
    ):
        fusion.fuse([model, model])
    cumulative = nn.Sequential(nn.BatchNorm1d(4, momentum=None))
    with pytest.raises(
        TypeError,
        match=r"models\[0\]\.0=<BatchNorm1d>: .*momentum=None.*; give the layer a float momentum",
    ):
        fusion.fuse([cumulative])


def test_fuse_refuses_a_fused_module_and_mixed_devices() -> None:
    fused = fusion.fuse([mlp(0), mlp(1)])
    with pytest.raises(
        ValueError, match=r"models\[0\]=<FusedModule>: is already a FusedModule; fuse the original"
    ):
        fusion.fuse([fused, fused])
    with pytest.raises(
        ValueError, match=r"models\[1\]\.inner=<FusedModule>: is already a FusedModule"
    ):
        holder = nn.Module()
        holder.inner = fused
        fusion.fuse([mlp(0), holder])
    with pytest.raises(
        ValueError,
        match=r"models\[1\]=<Sequential>: is on device meta but models\[0\] on cpu; move",
    ):
        fusion.fuse([mlp(0), mlp(1).to("meta")])


def test_the_originals_are_left_as_they_were() -> None:
    model = mlp(0)
    before = copy.deepcopy(model.state_dict())
    fused = fusion.fuse([model, mlp(1)])
    with torch.no_grad():
        for p in fused.parameters():
            p.add_(1.0)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name])


def test_forward_hooks_of_the_model_still_run() -> None:
    model = mlp(0)
    calls: list[tuple[int, ...]] = []
    model[1].register_forward_hook(lambda module, args, out: calls.append(tuple(out.shape)))
    fused = fusion.fuse([model, mlp(1)])
    fused(torch.randn(5, 16))
    assert calls == [(5, 32)]  # once per forward, seeing one model's activation (under vmap)


class ReadsAValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * float(self.linear.weight.sum())


def test_a_forward_vmap_cannot_batch_fails_with_a_fusion_error_naming_the_module() -> None:
    holder = nn.Sequential(nn.Linear(2, 2), ReadsAValue())
    fused = fusion.fuse([holder, copy.deepcopy(holder)])
    with pytest.raises(fusion.FusionError) as info:
        fused(torch.randn(3, 2))
    assert info.value.path == "1"
    text = str(info.value)
    assert text.startswith("model.1=<ReadsAValue>: cannot run batched for the 2 fused models"), text
    assert ".item()" in text and "train these models unfused" in text, text


class TiedEmbedding(nn.Module):
    """Input embedding and output layer share one weight (weight tying)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.out = nn.Linear(4, 7, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(tokens))  # type: ignore[no-any-return]


def test_tied_weights_stay_one_tensor_when_fused_and_unfused() -> None:
    torch.manual_seed(0)
    models = [TiedEmbedding() for _ in range(3)]
    fused = fusion.fuse(models)
    assert [name for name, _ in fused.named_parameters()] == ["stacked.embed.weight"]
    tokens = torch.randint(0, 7, (5,))
    out = fused(tokens)
    out.square().sum().backward()
    (table,) = fused.parameters()
    for k, model in enumerate(models):
        ref = model(tokens)
        torch.testing.assert_close(out[k], ref, **TOL)
        ref.square().sum().backward()
        assert table.grad is not None and model.embed.weight.grad is not None
        torch.testing.assert_close(table.grad[k], model.embed.weight.grad, **TOL)
    for k, model in enumerate(fused.unfuse()):
        assert model.out.weight is model.embed.weight
        torch.testing.assert_close(model.embed.weight, table[k].detach())


class SharedLayers(nn.Module):
    """One depthwise convolution and one dropout reached by two paths, as CoaT's position
    encoding is shared by every block of a stage; the forward reshapes (so it runs under vmap)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoding = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.drop = nn.Dropout(0.0)
        self.blocks = nn.ModuleList([nn.Sequential(self.encoding, self.drop) for _ in range(2)])
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x.transpose(2, 3))
        return self.head(x.mean((2, 3)))  # type: ignore[no-any-return]


@pytest.mark.parametrize("kernels", [True, False])
def test_a_layer_shared_by_two_paths_stays_shared_and_gets_its_gradient(kernels: bool) -> None:
    # Before, the shared convolution got no gradient (functional_call swapped its slot once per
    # path and restored vmap's batched tensor into it), and only one path got the fused kernel.
    torch.manual_seed(0)
    models = [SharedLayers() for _ in range(2)]
    fused = fusion.fuse(models, kernels=kernels)
    shared = fused.stacked.blocks[0][0]
    assert shared is fused.stacked.encoding and shared is fused.stacked.blocks[1][0]
    assert fused.stacked.blocks[0][1] is fused.stacked.blocks[1][1]
    x = torch.randn(3, 4, 5, 5)
    for _ in range(2):  # the second step reads what the first left in the module
        out = fused(x)
        for k, model in enumerate(models):
            torch.testing.assert_close(out[k], model(x), **TOL)
        fused.zero_grad()
        out.square().sum().backward()
        assert type(shared.weight) is nn.Parameter and shared.weight.shape[0] == 2
        for k, model in enumerate(models):
            model.zero_grad()
            model(x).square().sum().backward()
            for name, param in fused.stacked.named_parameters():
                grad = model.get_parameter(name).grad
                assert param.grad is not None and grad is not None, name
                torch.testing.assert_close(param.grad[k], grad, **TOL)


@pytest.mark.parametrize(
    ("call", "error", "start"),
    [
        (lambda: fusion.fuse([]), ValueError, "models=[]: "),
        (lambda: fusion.fuse([mlp(0), nn.Linear(2, 2)]), ValueError, "models[1]=<Linear>: "),
        (lambda: fusion.fuse([nn.LSTM(2, 2)]), TypeError, "models[0]=<LSTM>: "),
        (lambda: fusion.fuse([mlp(0), mlp(1).to("meta")]), ValueError, "models[1]=<Sequential>: "),
        (lambda: fusion.fuse([mlp(0)]).keep_models([5]), ValueError, "indices=[5]: "),
        (lambda: fusion.structure_key(3), TypeError, "model=3: "),
    ],
)
def test_errors_share_the_projects_one_format(call: object, error: type, start: str) -> None:
    with pytest.raises(error) as info:
        call()  # type: ignore[operator]
    text = str(info.value)
    assert text.startswith(start), text
    assert "; " in text and text.endswith("."), text
