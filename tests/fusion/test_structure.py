"""fusion.structure_key: equal exactly for the models that can fuse."""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import re

import pytest
import torch
from torch import nn

from waterwave_hpo import fusion


def net(**conv: object) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, **conv), nn.BatchNorm2d(4), nn.Dropout(0.1))  # type: ignore[arg-type]


def test_equal_for_the_same_architecture_whatever_the_weights_and_dropout_rate() -> None:
    a, b = net(), net()
    b[2].p = 0.7
    assert fusion.structure_key(a) == fusion.structure_key(b)
    assert hash(fusion.structure_key(a)) == hash(fusion.structure_key(b))
    assert fusion.structure_key(a).difference(fusion.structure_key(b)) is None


@pytest.mark.parametrize(
    ("other", "difference"),
    [
        (net(stride=2), "module '0': Conv2d(.*stride=(1, 1).* vs Conv2d(.*stride=(2, 2)"),
        (
            nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, eps=1e-3), nn.Dropout(0.1)),
            "eps=1e-05.* vs .*eps=0.001",
        ),
        (
            nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout2d(0.1)),
            "module '2': Dropout(.* vs Dropout2d(",
        ),
        (
            nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)),
            "module 2: Dropout(inplace=False) is missing in the other model",
        ),
        (net(bias=False), "parameter '0.bias' vs '1.weight'"),
    ],
)
def test_differences_are_named(other: nn.Module, difference: str) -> None:
    import re

    text = fusion.structure_key(net()).difference(fusion.structure_key(other))
    assert text is not None
    assert re.search(re.escape(difference).replace(r"\.\*", ".*"), text), text
    assert fusion.structure_key(net()) != fusion.structure_key(other)


def test_frozen_parameters_enter_the_key() -> None:
    a, b = net(), net()
    b[0].weight.requires_grad_(False)
    assert "requires_grad=True vs" in (
        fusion.structure_key(a).difference(fusion.structure_key(b)) or ""
    )


def test_str_lists_modules_and_tensors_readably() -> None:
    text = str(fusion.structure_key(nn.Sequential(nn.Linear(4, 8))))
    assert text.splitlines()[0] == "<model>: Sequential()"
    assert "0: Linear(in_features=4, out_features=8)" in text
    assert "0.weight: parameter (8, 4) torch.float32" in text


def test_rejects_a_non_module() -> None:
    with pytest.raises(TypeError, match=r"model='net': must be an nn.Module, not str"):
        fusion.structure_key("net")  # type: ignore[arg-type]


class _Configured(nn.Module):
    """A NAS-style cell whose forward reads a plain attribute: ``self.cfg``."""

    def __init__(self, cfg: object, name: str = "cfg") -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self._name = name
        setattr(self, name, cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = getattr(self, self._name)
        if isinstance(cfg, _Hparams):
            cfg = cfg.scale
        y: torch.Tensor = self.linear(x)
        if isinstance(cfg, dict):
            return torch.relu(y) if cfg["act"] == "relu" else torch.tanh(y)
        if isinstance(cfg, str):
            return torch.relu(y) if cfg == "relu" else torch.tanh(y)
        if isinstance(cfg, float):
            return y * cfg
        if isinstance(cfg, list):
            return y * cfg[0] + cfg[1]
        assert callable(cfg)
        out: torch.Tensor = cfg(y)
        return out


@dataclasses.dataclass
class _Hparams:
    scale: float


def _scale(factor: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda y: y * factor


@pytest.mark.parametrize(
    ("name", "cfg_0", "cfg_1", "difference"),
    [
        (
            "cfg",
            {"act": "relu"},
            {"act": "tanh"},
            r"cfg={'act': 'relu'}\) vs .*cfg={'act': 'tanh'}",
        ),
        ("_act", "relu", "tanh", r"_act='relu'.*\) vs .*_act='tanh'"),
        ("hp", _Hparams(0.5), _Hparams(2.0), r"hp=_Hparams\(scale=0.5\)\) vs .*scale=2.0"),
        ("fn", torch.relu, torch.tanh, r"fn=torch\..*relu.*\) vs .*fn=torch\..*tanh"),
        ("fn", _scale(0.5), _scale(2.0), r"closure=\(factor=0.5\).*\) vs .*factor=2.0"),
        ("cfg", [1.0, 0.0], [1.0, 3.0], r"cfg=\[1.0, 0.0\]\) vs .*cfg=\[1.0, 3.0\]"),
    ],
    ids=["dict", "private-str", "number-in-dataclass", "callable", "closure", "list"],
)
def test_fuse_refuses_models_whose_forward_differs_through_a_plain_attribute(
    name: str, cfg_0: object, cfg_1: object, difference: str
) -> None:
    # Before, the key described a dict, a list, a dataclass and a builtin function by their
    # type only and skipped private attributes: fuse() accepted these pairs and model 1 then
    # computed model 0's function.
    torch.manual_seed(0)
    models = [_Configured(cfg_0, name), _Configured(cfg_1, name)]
    x = torch.randn(3, 4)
    alone = _Configured(cfg_0, name)
    alone.load_state_dict(models[1].state_dict())
    assert not torch.allclose(models[1](x), alone(x))
    with pytest.raises(
        ValueError, match=r"models\[1\]=.*differs from models\[0\] in structure"
    ) as caught:
        fusion.fuse(models)
    assert re.search(difference, str(caught.value)), str(caught.value)


def test_equal_plain_attributes_still_fuse_and_each_model_keeps_its_function() -> None:
    torch.manual_seed(0)
    models = [_Configured({"act": "tanh", "depth": [1, 2]}) for _ in range(3)]
    x = torch.randn(5, 4)
    fused = fusion.fuse(models)
    for k, model in enumerate(models):
        torch.testing.assert_close(fused(x)[k], model(x))


def test_private_attributes_enter_the_key() -> None:
    a, b = _Configured("relu"), _Configured("relu")
    a._mode, b._mode = "relu", "tanh"  # type: ignore[assignment]
    assert fusion.structure_key(a) != fusion.structure_key(b)
    text = fusion.structure_key(a).difference(fusion.structure_key(b)) or ""
    assert "module '<model>': _Configured(_mode='relu', _name='cfg', cfg='relu') vs" in text


def test_a_tensor_attribute_that_is_not_a_buffer_enters_the_key_by_value() -> None:
    a, b = _Configured(0.5), _Configured(0.5)
    a.scale, b.scale = torch.ones(3), torch.ones(3)
    assert fusion.structure_key(a) == fusion.structure_key(b)
    b.scale = torch.full((3,), 2.0)
    assert fusion.structure_key(a) != fusion.structure_key(b)
