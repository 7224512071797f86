"""What a worker process starts from: the objective and the run's settings, pickled by value.

Worker processes never run the user's script (they are forked from a zygote that imported only
torch, Optuna and this package, or spawned as fresh interpreters: no CUDA context, no lock, no
thread inherited from the driver), so everything they run crosses as bytes. ``cloudpickle``
carries closures, lambdas and functions defined in ``__main__`` or a notebook by value; a
function of an importable module goes by reference and is imported in the worker. What cannot
be pickled (an objective holding a lock, an open file, a database connection) is refused before
any trial is asked, naming the fix.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
import itertools
from typing import TYPE_CHECKING
from typing import Any
from typing import ClassVar

import torch

from waterwave_hpo import _checks
from waterwave_hpo import _optuna_compat
from waterwave_hpo.host import HostSpec
from waterwave_hpo.host import MemoryPoolMode
from waterwave_hpo.host import PlanSettings
from waterwave_hpo.host import RunSettings
from waterwave_hpo.relay import StorageService
from waterwave_hpo.workers._environment import capture as capture_environment
from waterwave_hpo.workers._handle import ProcessHostHandle
from waterwave_hpo.workers._pool import WorkerPools

if TYPE_CHECKING:
    import optuna


def pickle_for_workers(name: str, value: object) -> bytes:
    """``value`` pickled with cloudpickle, or the argument's error in the one format.

    Raises:
        TypeError: If ``value`` cannot be pickled; the message names ``name``,
            ``isolation="process"`` and the fix.
    """
    try:
        return _dumps_keeping_source_files(value)
    except Exception as error:
        raise _checks.type_error(
            name,
            value,
            f"picklable, since isolation='process' sends it to worker processes (cloudpickle "
            f"said: {type(error).__name__}: {error})",
            "create what it holds that cannot be pickled (a lock, an open file or connection, "
            "a CUDA tensor) inside the objective, or use isolation='threads'",
        ) from error


def _dumps_keeping_source_files(value: object) -> bytes:
    """``cloudpickle.dumps(value)``, keeping the file name of the code it sends by value.

    cloudpickle writes ``"<dynamic-code>"`` as the file of every function it sends by value
    (closures, lambdas, the objective defined in the user's script); a trial's traceback from
    a worker would then name no file of the user's and show no source line. The worker runs on
    this machine, so the real file name is kept.
    """
    import io
    import types

    import cloudpickle

    reduce_code = cloudpickle.Pickler.dispatch_table.get(types.CodeType)
    if reduce_code is None:  # another cloudpickle: its own reduction, whatever it names
        return bytes(cloudpickle.dumps(value))

    def reduce_keeping_file(code: types.CodeType) -> Any:
        constructor, args = reduce_code(code)
        return constructor, tuple(
            code.co_filename if arg == "<dynamic-code>" else arg for arg in args
        )

    class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]
        dispatch_table: ClassVar[Any] = collections.ChainMap(
            {types.CodeType: reduce_keeping_file}, cloudpickle.Pickler.dispatch_table
        )

    buffer = io.BytesIO()
    _Pickler(buffer).dump(value)
    return buffer.getvalue()


def refuse_cuda_tensors(name: str, func: Any) -> None:
    """Refuse an objective that carries a CUDA tensor (in a global it reads or a closure cell).

    Such a tensor is pickled with the objective and reloaded onto the device in every worker
    before the worker's pool is in place: each worker would run without the pool and with its
    own copy of the data. Checked before any trial is asked.

    Raises:
        TypeError: Naming the global (or closed-over variable) that holds the tensor, and the
            fix.
    """
    for where, value in _captured(func):
        if _holds_cuda_tensor(value):
            raise _checks.type_error(
                name,
                func,
                f"free of CUDA tensors, since isolation='process' pickles it to every worker, "
                f"which would load {where} onto the device before its memory pool is in place "
                "(a copy per worker, outside the pool)",
                f"keep {where} on the CPU and move it inside the objective "
                "(.to(waterwave_hpo.current().device)), or use isolation='threads'",
            )


def _captured(func: Any) -> list[tuple[str, object]]:
    """``(description, value)`` of the globals ``func`` reads and the variables it closes over."""
    func = getattr(func, "__wrapped__", func)
    code = getattr(func, "__code__", None)
    if code is None:
        return []
    found: list[tuple[str, object]] = []
    module_globals = getattr(func, "__globals__", {})
    for name in _names(code):
        if name in module_globals:
            found.append((f"the global {name!r}", module_globals[name]))
    cells = getattr(func, "__closure__", None) or ()
    for name, cell in zip(code.co_freevars, cells, strict=False):
        try:
            found.append((f"the closed-over variable {name!r}", cell.cell_contents))
        except ValueError:  # an empty cell
            continue
    return found


def _names(code: Any) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names(const)
    return names


def _holds_cuda_tensor(value: object, depth: int = 0) -> bool:
    if isinstance(value, torch.Tensor):
        return bool(value.is_cuda)
    if depth > 2:
        return False
    if isinstance(value, torch.nn.Module):
        return any(t.is_cuda for t in itertools.chain(value.parameters(), value.buffers()))
    if isinstance(value, dict):
        return any(_holds_cuda_tensor(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_cuda_tensor(v, depth + 1) for v in value)
    return False


def process_hosts(
    pools: WorkerPools,
    devices: Sequence[torch.device],
    n_slots: int,
    settings: RunSettings,
    *,
    memory_pool: MemoryPoolMode,
    memory_budget_bytes: int | None,
    policy: Any,
    memory_plan: PlanSettings,
    reseed_sampler_rng: bool = True,
) -> list[ProcessHostHandle]:
    """The process hosts of one ``optimize`` call, one per device, on the executor's warm workers.

    The workers of every device start (in parallel) on the executor's first call and stay for
    its later ones; each host binds them to this call's study and objective.

    With ``reseed_sampler_rng`` (trials may run at once: ``HostSpec.reseed_sampler_rng``) each
    worker reseeds its copy of the sampler once, as it opens the run (distinct draws across
    workers); without it, one worker runs every trial with the driver's sampler as pickled, so
    a seeded sampler draws Optuna's sequence.

    Raises:
        TypeError: If the objective, the sampler, the pruner or ``catch`` cannot be pickled.
        RuntimeError: If no worker of a device could start (each died at start, or could not
            load the objective), with the first worker's error; before any trial is asked.
    """
    from optuna.storages._heartbeat import is_heartbeat_enabled

    study: optuna.Study = settings.study
    refuse_cuda_tensors("func", settings.func)
    pickle_for_workers("func", settings.func)
    pickle_for_workers("study.sampler", study.sampler)
    pickle_for_workers("study.pruner", study.pruner)
    heartbeat = is_heartbeat_enabled(_optuna_compat.storage_of(study))
    # The workers run the user's objective and sampler on the user's study: they may set its
    # attributes as they would under Study.optimize (NSGA-II's generations, QMC's sample id,
    # trial.study.set_user_attr); other studies stay out of reach.
    service = StorageService(study, study_attrs=True)
    environment = capture_environment()
    device_pools = [
        pools.pool(device, n_slots, memory_budget_bytes, memory_pool.value) for device in devices
    ]
    payloads: dict[int | None, bytes] = {}
    hosts: list[ProcessHostHandle] = []
    try:
        for pool in device_pools:
            # Each worker's scheduler (and memory plans) gets its share of the device's budget,
            # the same bytes as its lease; with no budget given, that of the device's default
            # budget, resolved here (a worker would plan for the whole device).
            share = pool.leases.share_bytes
            if memory_budget_bytes is not None:
                share = memory_budget_bytes // n_slots
            if share not in payloads:
                spec = HostSpec.of_run(
                    settings,
                    None,
                    n_slots=1,
                    admit_by_memory=False,
                    memory_pool=memory_pool,
                    memory_budget_bytes=share,
                    policy=policy,
                    memory_plan=memory_plan,
                    record_trial_attrs=settings.record_trial_attrs,
                    reseed_sampler_rng=reseed_sampler_rng,
                )
                payloads[share] = pickle_for_workers("catch", (spec, heartbeat, environment))
            hosts.append(ProcessHostHandle(pool, settings, payloads[share], service))
    except BaseException:
        for host in hosts:
            host.shutdown(timeout_s=5.0)
        raise
    return hosts
