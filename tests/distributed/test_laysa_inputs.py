"""laysa(): bad input is refused with a clear error; a group of one process warns and runs dense.

These run in the test process on a one-process gloo group (no spawn).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from waterwave_hpo.distributed import Baseline
from waterwave_hpo.distributed import attach_baseline
from waterwave_hpo.distributed import laysa


@pytest.fixture(scope="module")
def one_process_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    rendezvous = Path(tmp_path_factory.mktemp("pg")) / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


pytestmark = pytest.mark.usefixtures("one_process_group")


def _model() -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("density", [0.0, -0.5, 1.5, float("nan")])
def test_density_outside_0_1_is_a_value_error_naming_it(density: float) -> None:
    model, optimizer = _model()
    with pytest.raises(ValueError, match=r"^density=.*: must be in \(0, 1\]"):
        laysa(model, density=density, optimizer=optimizer)


@pytest.mark.parametrize("density", ["0.1", True, None])
def test_density_of_the_wrong_type_is_a_type_error(density: object) -> None:
    model, optimizer = _model()
    with pytest.raises(TypeError, match=r"^density=.*: must be a float in \(0, 1\], not "):
        laysa(model, density=density, optimizer=optimizer)  # type: ignore[arg-type]


def test_a_plain_module_is_a_type_error_saying_to_wrap_it() -> None:
    with pytest.raises(
        TypeError,
        match=r"^ddp_model=Linear.*: must be a torch\.nn\.parallel\.DistributedDataParallel, "
        r"not Linear; wrap the model: DistributedDataParallel\(model\)",
    ):
        laysa(
            torch.nn.Linear(4, 2), optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)])
        )  # type: ignore[arg-type]


def test_a_model_with_nothing_to_train_is_a_value_error() -> None:
    model, optimizer = _model()
    for param in model.parameters():
        param.requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter with requires_grad=True"):
        laysa(model, optimizer=optimizer)


def test_an_optimizer_missing_parameters_is_a_value_error_naming_them() -> None:
    model, _ = _model()
    optimizer = torch.optim.SGD([model.module.weight], lr=0.1)
    with pytest.raises(ValueError, match=r"\['bias'\].*ddp_model.parameters\(\)"):
        laysa(model, optimizer=optimizer)


def test_warmup_below_one_step_is_a_value_error() -> None:
    model, optimizer = _model()
    with pytest.raises(ValueError, match=r"^warmup_steps=0: must be >= 1"):
        laysa(model, optimizer=optimizer, warmup_steps=0)


def test_an_unsupported_backend_is_a_value_error_naming_the_fix() -> None:
    import torch.testing._internal.distributed.fake_pg  # registers the "fake" backend

    group = dist.new_group(backend="fake")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2), process_group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"backend is 'fake' but LaySA supports gloo and nccl"):
        laysa(model, optimizer=optimizer, process_group=group)
    with pytest.raises(ValueError, match="backend is 'fake'"):
        attach_baseline(model, Baseline.NAIVE_TOPK, process_group=group)


def test_a_baseline_that_is_not_a_baseline_is_a_type_error() -> None:
    model, _ = _model()
    with pytest.raises(TypeError, match=r"^baseline='dense': must be a Baseline, not str"):
        attach_baseline(model, "dense")  # type: ignore[arg-type]


def test_one_process_warns_once_and_trains_dense() -> None:
    model, optimizer = _model()
    torch.manual_seed(0)
    reference = torch.nn.Linear(4, 2)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    laysa(model, density=0.01, optimizer=optimizer)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            for net, opt in ((model, optimizer), (reference, reference_optimizer)):
                opt.zero_grad()
                torch.nn.functional.mse_loss(net(x), y).backward()
                opt.step()
    ours = [w for w in caught if "one process" in str(w.message)]
    assert len(ours) == 1
    assert issubclass(ours[0].category, RuntimeWarning)
    for a, b in zip(model.module.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:LaySA. the process group has one process")
def test_the_state_pickles_like_powersgds_without_its_process_group() -> None:
    import pickle

    model, optimizer = _model()
    attached = laysa(model, density=0.25, optimizer=optimizer, warmup_steps=3)
    x = torch.randn(8, 4)
    for _ in range(2):
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
    loaded = pickle.loads(pickle.dumps(attached.state))
    assert (loaded.density, loaded.warmup_steps, loaded.iteration) == (0.25, 3, 2)
    assert loaded.process_group is dist.group.WORLD
    assert loaded.restored_state_dict == attached.state_dict()
