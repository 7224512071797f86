"""The fusion zoo's CI subset: timm and transformers models fuse (the ``zoo`` extra).

Not skipped without timm/transformers: CI installs the ``zoo`` extra, and a missing install
must fail here, not pass. The whole sample is ``python experiments/fusion_zoo.py``.
"""

from __future__ import annotations

import pytest

from waterwave_hpo import bench


@pytest.mark.parametrize("name", bench.FAST_SAMPLE)
def test_fast_zoo_model_fuses_and_matches_each_model_alone(name: str) -> None:
    # Before mobilenetv3 (Hardswish) and ghostnet (Hardsigmoid) were refused by a
    # hand list; the ViT, BERT and GPT-2 crashed inside vmap on .item(); BERT's input_ids=
    # raised TypeError.
    result = bench.check_case(bench.zoo_case(name, fast=True))
    assert result.outcome is bench.ZooOutcome.FUSED, result.detail
    assert result.output_error <= 2e-4


def test_a_model_that_cannot_run_batched_is_refused_with_its_path_not_crashed() -> None:
    # T5 built without use_cache=False returns an EncoderDecoderCache vmap cannot return.
    import transformers as hf

    case = bench.zoo_case("t5")
    config = case.build().config
    config.use_cache = True
    refused = bench.ZooCase(
        "transformers",
        "t5 with a cache",
        lambda: hf.T5ForConditionalGeneration(config),
        case.args,
        case.kwargs,
    )
    result = bench.check_case(refused)
    assert result.outcome is bench.ZooOutcome.REFUSED, result.detail
    assert "EncoderDecoderCache" in result.detail and result.path == ""
