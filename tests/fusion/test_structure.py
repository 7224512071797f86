"""fusion.structure_key: equal exactly for the models that can fuse."""

from __future__ import annotations

import pytest
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
