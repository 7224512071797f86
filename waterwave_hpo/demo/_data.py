"""The demo's data: scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from waterwave_hpo import _checks


@dataclass(frozen=True)
class Digits:
    """Train and validation tensors on the CPU.

    Attributes:
        x_train: ``[N_train, 1, 8, 8]`` float32 pixel intensities scaled to [0, 1].
        y_train: ``[N_train]`` int64 class labels 0..9.
        x_val: ``[N_val, 1, 8, 8]`` float32.
        y_val: ``[N_val]`` int64.
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor

    def to(self, device: torch.device) -> Digits:
        """The same data on ``device``."""
        return Digits(*(t.to(device) for t in (self.x_train, self.y_train, self.x_val, self.y_val)))


def load_digits(val_fraction: float = 0.2) -> Digits:
    """Load the digits that ship with scikit-learn and split them, stratified by class.

    The split is fixed (``random_state=0``) so every trial, and every run of the demo, is scored
    on the same validation images whatever ``--seed`` is.

    Args:
        val_fraction: Fraction of the 1797 images held out for validation, in (0, 1).

    Raises:
        ValueError: If ``val_fraction`` is not in (0, 1).
    """
    if not 0.0 < val_fraction < 1.0:
        raise _checks.value_error(
            "val_fraction", val_fraction, "must be in (0, 1)", "pass e.g. 0.2"
        )
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    bunch = sklearn_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(bunch.target, dtype=torch.int64)
    train_idx, val_idx = train_test_split(
        list(range(len(labels))), test_size=val_fraction, random_state=0, stratify=bunch.target
    )
    train = torch.tensor(train_idx)
    val = torch.tensor(val_idx)
    return Digits(images[train], labels[train], images[val], labels[val])
