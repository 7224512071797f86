"""PyTorch glue that needs no GPU: typed OOM translation and use_pool argument checks."""

from __future__ import annotations

import pytest

from waterwave_hpo.memory import OOM_MARKER
from waterwave_hpo.memory import StreamAwarePool
from waterwave_hpo.memory import is_pool_oom
from waterwave_hpo.memory import translate_oom
from waterwave_hpo.memory import use_pool

torch = pytest.importorskip("torch")


def test_pool_exhaustion_inside_torch_becomes_out_of_memory_error() -> None:
    # What PyTorch raises when waterwave_torch_malloc throws (pytorch/pytorch issue 133280).
    raw = RuntimeError(f"{OOM_MARKER}: CUDA out of memory on device 0: out of memory: 1 bytes")
    assert is_pool_oom(raw)
    with pytest.raises(torch.cuda.OutOfMemoryError) as info, translate_oom():
        raise raw
    assert info.value.__cause__ is raw
    assert OOM_MARKER in str(info.value)


def test_translate_oom_passes_other_errors_through() -> None:
    with pytest.raises(RuntimeError, match="shape mismatch") as info, translate_oom():
        raise RuntimeError("shape mismatch")
    assert not isinstance(info.value, torch.cuda.OutOfMemoryError)

    @translate_oom()
    def objective() -> int:
        raise ValueError("bad hyperparameter")

    with pytest.raises(ValueError, match="bad hyperparameter"):
        objective()


def test_use_pool_refuses_a_sim_pool() -> None:
    with pytest.raises(ValueError, match="sim"):
        use_pool(StreamAwarePool(backend="sim"))


def test_use_pool_refuses_what_is_not_a_pool() -> None:
    with pytest.raises(TypeError, match=r"^pool='cuda': must be a StreamAwarePool, not str"):
        use_pool("cuda")  # type: ignore[arg-type]
