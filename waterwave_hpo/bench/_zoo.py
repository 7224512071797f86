"""A model zoo for fusion: timm and transformers models fused, verified and counted.

Each :class:`ZooCase` builds one model of a public library from its config (``pretrained=False``,
nothing downloaded) and an example input. :func:`check_case` fuses K fresh copies with
``fusion.fuse(models, example_inputs=...)`` (which verifies them) and then checks the fused module
independently of :func:`~waterwave_hpo.fusion.verify`: a train-mode forward against each model
alone and a backward. The outcome is one of four (:class:`ZooOutcome`): fused (and equal), refused
clearly (a :class:`~waterwave_hpo.fusion.FusionError`, or ``fuse``'s up-front refusal, naming a
module path), crashed (any other error), wrong (accepted, but an output differs).

timm and transformers are optional (the ``zoo`` extra); they are imported on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
import enum
import re
import sys
import traceback
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from waterwave_hpo import fusion

TIMM_SAMPLE: tuple[str, ...] = (
    "resnet18",
    "resnet26d",
    "resnext26ts",
    "seresnet18",
    "densenet121",
    "mobilenetv2_050",
    "efficientnet_b0",
    "mnasnet_small",
    "regnetx_002",
    "rexnet_100",
    "convnext_atto",
    "convnextv2_atto",
    "edgenext_xx_small",
    "resmlp_12_224",
    "mixer_s32_224",
    "poolformer_s12",
    "efficientformer_l1",
    "tinynet_e",
    "dla34",
    "vgg11",
    "inception_v3",
    "xception41",
    "mobilenetv3_small_050",
    "levit_128s",
    "lcnet_050",
    "ghostnet_050",
    "hrnet_w18_small",
    "vit_tiny_patch16_224",
    "deit_tiny_patch16_224",
    "mobilevit_xxs",
    "coat_lite_tiny",
)
"""The zoo's 31 timm models: convolutional, MLP, hybrid and attention families (CoaT's
convolutional position encoding is one layer shared by every block of a stage)."""

TIMM_FAST: tuple[str, ...] = (
    "resnet18",
    "mobilenetv3_small_050",
    "ghostnet_050",
    "vit_tiny_patch16_224",
)
"""A subset small enough for CI: a CNN, Hardswish, Hardsigmoid and attention (ViT at 32x32)."""

TRANSFORMERS_SAMPLE: tuple[str, ...] = ("bert", "gpt2", "vit", "t5")
"""transformers models built from small configs: encoder, decoder, vision, encoder-decoder."""

FAST_SAMPLE: tuple[str, ...] = (*TIMM_FAST, "bert", "gpt2")
"""The CI subset: :data:`TIMM_FAST` and two transformers models given keyword inputs."""


class ZooOutcome(enum.Enum):
    """What happened to one model of the zoo."""

    FUSED = "fused"
    REFUSED = "refused"
    CRASHED = "crashed"
    WRONG = "wrong"


@dataclass(frozen=True)
class ZooCase:
    """One model of the zoo: how to build it and what to feed it.

    Attributes:
        library: ``"timm"`` or ``"transformers"``.
        name: The model's name (timm) or family (transformers).
        build: Builds one fresh model (random weights, dropout at 0).
        args: Positional example inputs of one model, ``(B, ...)`` each.
        kwargs: Keyword example inputs of one model.
    """

    library: str
    name: str
    build: Callable[[], nn.Module]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class ZooResult:
    """The outcome for one model.

    Attributes:
        library: ``"timm"`` or ``"transformers"``.
        name: The model's name.
        outcome: Fused, refused, crashed or wrong.
        output_error: Largest output difference, fused vs alone, relative to the largest
            magnitude (NaN when not fused).
        path: The module path a refusal named (``""`` for the whole model, None otherwise).
        detail: The refusal's or the error's message (first line), or ``""``.
        seconds: Wall-clock time of the check, in seconds.
    """

    library: str
    name: str
    outcome: ZooOutcome
    output_error: float
    path: str | None
    detail: str
    seconds: float


def _import_torchvision() -> None:
    """``import torchvision``, also beside a CPU build of torch with PyPI's (CUDA) torchvision.

    PyPI's torchvision wheel is built for CUDA torch; beside torch's CPU wheel its C operators
    do not load, and its import then fails registering fake kernels for two of them
    (``RuntimeError: operator torchvision::nms does not exist``). This declares those two
    schemas (no kernel: calling them raises) so torchvision imports; no model here calls them.
    timm imports torchvision, and so do transformers' vision models.
    """
    try:
        import torchvision
    except ImportError:
        return  # not installed: the importer that needs it says so
    except RuntimeError as error:
        if "torchvision::" not in str(error):
            raise
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        for op in ("nms", "qnms"):
            try:
                torch.library.define(
                    f"torchvision::{op}",
                    "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
                )
            except RuntimeError:
                pass  # already declared
        import torchvision  # noqa: F401


def import_timm() -> Any:
    """``import timm`` (see :func:`_import_torchvision` for a CPU torch beside PyPI's torchvision).

    Returns:
        The ``timm`` module.

    Raises:
        ImportError: timm or torchvision is not installed (``pip install waterwave-hpo[zoo]``).
    """
    _import_torchvision()
    import timm

    return timm


def _timm_case(name: str, *, size: int | None = None, batch: int = 2) -> ZooCase:
    """A timm model at ``size`` (64 unless its input size is fixed), dropout off."""
    timm = import_timm()
    options: dict[str, Any] = {"pretrained": False, "drop_rate": 0.0, "drop_path_rate": 0.0}
    if size is not None and name.startswith(("vit_", "deit_")):
        options["img_size"] = size

    def build() -> nn.Module:
        try:
            return timm.create_model(name, **options)  # type: ignore[no-any-return]
        except TypeError:  # a family without drop_path_rate
            del options["drop_path_rate"]
            return timm.create_model(name, **options)  # type: ignore[no-any-return]

    probe = build()
    config = getattr(probe, "pretrained_cfg", {}) or {}
    side = size if size is not None else 64
    if size is None and config.get("fixed_input_size"):
        side = int(config["input_size"][-1])
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, side, side, generator=generator)
    if size is None and side != int(config.get("input_size", (3, side, side))[-1]):
        try:
            with torch.no_grad():
                probe.eval()(x)
        except RuntimeError:  # too small for the model (inception_v3 needs 75x75): its own size
            side = int(config["input_size"][-1])
            x = torch.randn(batch, 3, side, side, generator=generator)
    return ZooCase("timm", name, build, (x,), {})


def _transformers_case(family: str, *, batch: int = 2, length: int = 8) -> ZooCase:
    """A small transformers model of ``family`` from a config (2 layers, width 64)."""
    _import_torchvision()
    import transformers as hf

    generator = torch.Generator().manual_seed(1)
    vocab = 128
    ids = torch.randint(0, vocab, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, -3:] = 0  # padding in the first sequence: the mask code runs
    small: dict[str, Any] = {"num_hidden_layers": 2, "num_attention_heads": 2}
    if family == "bert":
        config = hf.BertConfig(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **small,
        )
        return ZooCase(
            "transformers",
            "bert (BertForSequenceClassification)",
            lambda: hf.BertForSequenceClassification(config),
            (),
            {"input_ids": ids, "attention_mask": mask},
        )
    if family == "gpt2":
        gpt = hf.GPT2Config(
            vocab_size=vocab,
            n_embd=64,
            n_layer=2,
            n_head=2,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
            use_cache=False,  # training: a DynamicCache is not a tensor vmap can return
        )
        return ZooCase(
            "transformers",
            "gpt2 (GPT2LMHeadModel)",
            lambda: hf.GPT2LMHeadModel(gpt),
            (),
            {"input_ids": ids, "attention_mask": mask},
        )
    if family == "vit":
        vit_options: dict[str, Any] = {
            "image_size": 32,
            "patch_size": 8,
            "hidden_size": 64,
            "intermediate_size": 128,
            "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0,
            "num_labels": 10,
            **small,
        }
        vit = hf.ViTConfig(**vit_options)
        pixels = torch.randn(batch, 3, 32, 32, generator=generator)
        return ZooCase(
            "transformers",
            "vit (ViTForImageClassification)",
            lambda: hf.ViTForImageClassification(vit),
            (),
            {"pixel_values": pixels},
        )
    if family == "t5":
        t5_options: dict[str, Any] = {
            "vocab_size": vocab,
            "d_model": 64,
            "d_kv": 32,
            "d_ff": 128,
            "num_layers": 2,
            "num_decoder_layers": 2,
            "num_heads": 2,
            "dropout_rate": 0.0,
            "decoder_start_token_id": 0,
            "pad_token_id": 0,
            "use_cache": False,  # training: an EncoderDecoderCache is not a tensor vmap returns
        }
        t5 = hf.T5Config(**t5_options)
        labels = torch.randint(1, vocab, (batch, length), generator=generator)
        return ZooCase(
            "transformers",
            "t5 (T5ForConditionalGeneration)",
            lambda: hf.T5ForConditionalGeneration(t5),
            (),
            {"input_ids": ids, "attention_mask": mask, "labels": labels},
        )
    raise ValueError(f"family={family!r}: unknown; pass one of {TRANSFORMERS_SAMPLE}")


def zoo_case(name: str, *, fast: bool = False) -> ZooCase:
    """One case of the zoo by name.

    Args:
        name: A timm model name (any, not only :data:`TIMM_SAMPLE`'s) or one of
            :data:`TRANSFORMERS_SAMPLE`.
        fast: As in :func:`zoo_cases` (ViTs at 32x32).

    Returns:
        The case.
    """
    if name in TRANSFORMERS_SAMPLE:
        return _transformers_case(name)
    return _timm_case(name, size=32 if fast and name.startswith("vit_") else None)


def zoo_cases(*, fast: bool = False) -> list[ZooCase]:
    """The zoo: timm's sample, then transformers' (built lazily: each case builds its model).

    Args:
        fast: The CI subset (:data:`TIMM_FAST` at 32x32 for ViT, and BERT, GPT-2) instead of
            the whole sample.

    Returns:
        The cases, timm first.
    """
    if fast:
        return [zoo_case(name, fast=True) for name in FAST_SAMPLE]
    return [_timm_case(n) for n in TIMM_SAMPLE] + [
        _transformers_case(f) for f in TRANSFORMERS_SAMPLE
    ]


_PATH = re.compile(r"^models?(?:\[0\])?(?:\.(?P<path>[^=]*))?=")


def _refused_path(text: str) -> str | None:
    """The module path an error message of fusion names, or None if it names none."""
    match = _PATH.match(text)
    if match is None:
        return None
    return match.group("path") or ""


def check_case(case: ZooCase, *, num_models: int = 2, rtol: float = 2e-4) -> ZooResult:
    """Fuse ``num_models`` fresh copies of ``case``'s model, check and classify the outcome.

    Args:
        case: The model and its example input.
        num_models: K.
        rtol: Largest accepted output difference relative to the output's largest magnitude.

    Returns:
        The outcome. Never raises for a model's failure (that is the outcome); raises only
        for an error building the model or running it alone.
    """
    import time

    start = time.perf_counter()
    torch.manual_seed(0)
    models = [case.build().train() for _ in range(num_models)]

    def result(outcome: ZooOutcome, error: float, path: str | None, detail: str) -> ZooResult:
        seconds = time.perf_counter() - start
        return ZooResult(case.library, case.name, outcome, error, path, detail, seconds)

    try:
        fused = fusion.fuse(models, example_inputs=case.args or None, example_kwargs=case.kwargs)
    except fusion.FusionError as error:
        return result(ZooOutcome.REFUSED, float("nan"), error.path, str(error).splitlines()[0])
    except (TypeError, ValueError) as error:
        text = str(error).splitlines()[0]
        path = _refused_path(text)
        if path is not None:
            return result(ZooOutcome.REFUSED, float("nan"), path, text)
        return result(ZooOutcome.CRASHED, float("nan"), None, _last_line(error))
    except Exception as error:
        return result(ZooOutcome.CRASHED, float("nan"), None, _last_line(error))
    try:
        out = fused(*case.args, **case.kwargs)
        leaves = pytree.tree_leaves(out)
        worst = 0.0
        for k, model in enumerate(models):
            alone = pytree.tree_leaves(model(*case.args, **case.kwargs))
            for mine, ref in zip(leaves, alone, strict=True):
                if isinstance(ref, torch.Tensor) and ref.is_floating_point():
                    diff = float((mine[k].detach() - ref.detach()).abs().max())
                    scale = float(ref.detach().abs().max())
                    worst = max(worst, diff / scale if scale > 0 else diff)
        total = sum(leaf.float().sum() for leaf in leaves if _trainable(leaf))
        if isinstance(total, torch.Tensor):
            total.backward()  # type: ignore[no-untyped-call]
    except Exception as error:
        return result(ZooOutcome.CRASHED, float("nan"), None, _last_line(error))
    if worst > rtol:
        return result(ZooOutcome.WRONG, worst, None, f"output differs by {worst:.3g}")
    return result(ZooOutcome.FUSED, worst, None, "")


def _trainable(leaf: object) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.requires_grad


def _last_line(error: BaseException) -> str:
    """``Type: first line of the message`` and where it was raised."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}{where}"
