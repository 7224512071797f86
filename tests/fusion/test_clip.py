"""fusion.clip_grad_norm_: each model clipped by its own norm, as stock would clip it alone."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from waterwave_hpo import fusion

SHAPES = ((4, 5), (5,), (2, 3, 3))


def _fused_and_singles(scales: list[float]) -> tuple[list[nn.Parameter], list[list[nn.Parameter]]]:
    gen = torch.Generator().manual_seed(3)
    fused = [nn.Parameter(torch.zeros(len(scales), *s)) for s in SHAPES]
    for p in fused:
        p.grad = torch.randn(p.shape, generator=gen)
        for k, scale in enumerate(scales):
            p.grad[k] *= scale
    singles = []
    for k in range(len(scales)):
        ps = [nn.Parameter(torch.zeros(s)) for s in SHAPES]
        for p, q in zip(ps, fused, strict=True):
            p.grad = q.grad[k].clone()  # type: ignore[index]
        singles.append(ps)
    return fused, singles


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_each_model_is_clipped_as_stock_clips_it_alone(norm_type: float) -> None:
    fused, singles = _fused_and_singles([0.01, 1.0, 100.0])
    max_norms = [1.0, 2.0, 3.0]
    norms = fusion.clip_grad_norm_(fused, max_norms, norm_type)
    for k, ps in enumerate(singles):
        stock_norm = nn.utils.clip_grad_norm_(ps, max_norms[k], norm_type)
        torch.testing.assert_close(norms[k], stock_norm)
        for p, q in zip(ps, fused, strict=True):
            torch.testing.assert_close(q.grad[k], p.grad)  # type: ignore[index]


def test_one_models_nan_gradient_scales_no_other_model() -> None:
    fused, _ = _fused_and_singles([1.0, 1.0, 1.0])
    before = [p.grad.clone() for p in fused]  # type: ignore[union-attr]
    for p in fused:
        p.grad[1] = math.nan  # type: ignore[index]
    norms = fusion.clip_grad_norm_(fused, 1e9)  # no finite model is clipped
    assert norms[1].isnan() and norms[[0, 2]].isfinite().all()
    for p, b in zip(fused, before, strict=True):
        assert torch.equal(p.grad[[0, 2]], b[[0, 2]])  # type: ignore[index]


@pytest.mark.parametrize(
    ("max_norm", "error", "pattern"),
    [
        ([1.0, 2.0], ValueError, r"max_norm=\[1.0, 2.0\]: has 2 entries but there are K=3"),
        (0.0, ValueError, r"max_norm=0.0: must be > 0 and finite"),
        ("1", TypeError, r"max_norm='1': must be a number or a sequence of numbers"),
    ],
)
def test_bad_max_norm_is_refused(max_norm: object, error: type[Exception], pattern: str) -> None:
    fused, _ = _fused_and_singles([1.0, 1.0, 1.0])
    with pytest.raises(error, match=pattern):
        fusion.clip_grad_norm_(fused, max_norm)  # type: ignore[arg-type]


@pytest.mark.parametrize("max_norm", [1.0, [1.0, 2.0, 3.0]], ids=["one limit", "per model"])
def test_clipping_makes_no_blocking_host_to_device_copy(
    monkeypatch: pytest.MonkeyPatch, max_norm: float | list[float]
) -> None:
    """One limit is a scalar argument (no copy at all); per-model limits
    reach the device by one queued copy from pinned memory, never one the host waits for."""
    from fusion._copies import HostToDeviceCopies

    grads = [nn.Parameter(torch.zeros(3, *s, device="meta")) for s in SHAPES]
    for p in grads:
        p.grad = torch.ones(p.shape, device="meta")  # the (stand-in) device's gradients
    copies = HostToDeviceCopies(monkeypatch)
    with copies:
        norms = fusion.clip_grad_norm_(grads, max_norm)
    assert copies.blocking == []
    assert len(copies.copies) == (0 if isinstance(max_norm, float) else 1)
    assert norms.shape == (3,) and norms.device.type == "meta"
