"""The demo's timeline title says what ran at once: fuse and K named as such."""

from __future__ import annotations

import torch

from waterwave_hpo.demo._run import timeline_title


def test_the_title_of_a_fused_run_names_fuse_and_k() -> None:
    title = timeline_title(64, 4, 8, [torch.device("cpu")])
    assert "fuse=8" in title and "K=4 fused batch(es) per device" in title
    assert "up to 32 trials at once" in title
    assert "4 per device" not in title.replace("K=4 fused batch(es) per device", "")


def test_the_title_of_an_unfused_run_names_k() -> None:
    assert timeline_title(10, 2, None, [torch.device("cpu")]).endswith("K=2 per device on cpu")
