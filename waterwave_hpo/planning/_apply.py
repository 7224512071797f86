"""Applying a plan to a model: recompute through checkpoint, swap through saved-tensor hooks.

- **Recompute** units: each outermost module call of the unit runs under
  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False, preserve_rng_state=False)``, so
  its saved activations are dropped after forward and recomputed in backward. Its random ops
  (dropout...) are recorded in forward and replayed in the recompute (``planning/_rng.py``):
  the recompute sees exactly its forward's random numbers and never sets the process's
  generator, which co-hosted trials share (restoring it would rewind their streams). Buffers
  the recompute would update a second time (e.g. BatchNorm's running statistics) are restored
  after it, so the step changes them once.
- **Swap** units: while the unit's forward runs, ``torch.autograd.graph.saved_tensors_hooks``
  packs every saved activation into a host copy. On CUDA the copy goes to pinned host memory on
  a side stream, after that stream waits for the compute stream; an event marks its end. The
  device tensor is let go as soon as the copy is *ordered*: its memory is recorded on the side
  stream (``record_stream``), so the allocator reuses it only after the copy, with no host wait
  (the host runs ahead of the GPU: waiting to see the event complete would keep it all forward).
  When the backward of the unit after it begins (a gradient hook on that unit's output), the
  unit's activations are copied back on the side stream into memory allocated on the compute
  stream and recorded on the side stream (so its release follows the copy even when backward
  raises before using it), and the unpack hook makes the compute stream wait for that copy's
  event on the GPU.
  On the CPU the same code runs with synchronous copies (a real copy, so the path is tested).
- **Keep** units and work outside every unit: saved as usual; the hooks only count them.

Every device byte that autograd holds for the step is counted in a :class:`StepLedger` (a
storage once however often saved), the measure that checks a plan's predicted peak.

The three placements and applying them to a whole model at once are HOME's (He et al., IEEE
Trans. Computers 2022); the hooks, the prefetch trigger and the ledger are ours.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import threading
from typing import Any
import weakref

import torch
from torch import nn
import torch.utils._pytree
import torch.utils.checkpoint

from waterwave_hpo.nodegroup._internal import iter_tensors
from waterwave_hpo.nodegroup._internal import tensor_bytes
from waterwave_hpo.planning._cost import recompute_runs
from waterwave_hpo.planning._ledger import StepLedger
from waterwave_hpo.planning._plan import Placement
from waterwave_hpo.planning._plan import StepProfile
from waterwave_hpo.planning._rng import RandomRecord
from waterwave_hpo.planning._units import UnitModules


def _free_after(t: torch.Tensor, stream: Any) -> bool:
    """Order the release of ``t``'s device memory after the work queued on ``stream`` now.

    ``Tensor.record_stream`` semantics: when the last reference to the memory goes, the
    allocator hands it out again only after ``stream``'s work queued at that time has
    completed, and the host never waits. PyTorch's caching allocator does it; so does the
    waterwave pool, through ``Tensor.record_stream`` when its torch shim registered the hook,
    else through :meth:`~waterwave_hpo.memory.StreamAwarePool.record_stream`.

    Returns:
        False when it cannot be ordered (a swapped allocator that has no pool for the
        device): the caller must keep ``t`` alive, or order its free otherwise.
    """
    from waterwave_hpo import memory

    info = memory.allocator_info()
    if info.swapped and not info.record_stream:
        # A pluggable allocator drops Tensor.record_stream silently: tell the pool directly.
        pool = memory.device_pool(t.device.index if t.device.index is not None else 0)
        if pool is None:
            return False
        pool.record_stream(t.untyped_storage().data_ptr(), stream)
        return True
    t.record_stream(stream)
    return True


class _Transfer:
    """Host<->device copies: on CUDA on a side stream with events, on the CPU synchronous."""

    def __init__(self) -> None:
        self._side: dict[torch.device, Any] = {}

    def _side_stream(self, device: torch.device) -> Any:
        stream = self._side.get(device)
        if stream is None:
            stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            self._side[device] = stream
        return stream

    def to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, Any, Any, torch.Tensor | None]:
        """Copy ``t`` to host memory.

        Returns:
            (host copy, the copy's event or None, compute stream or None, what must be held):
            the last is ``t`` when its memory's reuse could not be ordered after the copy, so
            it must stay alive until the event has completed; None when ``t`` may be let go
            now (its release is ordered after the copy on the side stream, or the copy was
            synchronous).
        """
        if t.is_cuda:
            compute = torch.cuda.current_stream(t.device)
            side = self._side_stream(t.device)
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            side.wait_stream(compute)  # the activation is written on the compute stream
            with torch.cuda.stream(side):
                host.copy_(t, non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(side)  # type: ignore[no-untyped-call,unused-ignore]
            # The host runs ahead of the GPU: waiting for the event to be seen complete would
            # keep every swapped activation alive through the forward.
            # Hand the device memory's lifetime to the side stream instead: freed now, reused
            # by the allocator only after the copy (the pinned host buffer's lifetime is
            # tracked by torch's host allocator, which records the copy's stream itself).
            return host, event, compute, None if _free_after(t, side) else t
        host = torch.empty_like(t, device="cpu")
        host.copy_(t)
        return host, None, None, None

    def to_device(
        self, host: torch.Tensor, device: torch.device, compute: Any
    ) -> tuple[torch.Tensor, Any]:
        """Copy ``host`` back to ``device``; returns (device tensor, event or None)."""
        if device.type == "cuda":
            side = self._side_stream(device)
            with torch.cuda.stream(compute):  # owned by the compute stream, which reads it
                dev = torch.empty_like(host, device=device)
            side.wait_stream(compute)
            with torch.cuda.stream(side):
                dev.copy_(host, non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(side)  # type: ignore[no-untyped-call,unused-ignore]
            # If backward raises before the unpack made the compute stream wait for this copy,
            # ``dev`` is freed on the compute stream while the side stream may still write it:
            # order its release after the copy on every path.
            if not _free_after(dev, side):
                compute.wait_event(event)  # GPU-side: the compute stream's free follows it
            return dev, event
        dev = torch.empty_like(host, device=device)
        dev.copy_(host)
        return dev, None


class _Kept:
    """A saved activation left on the device, counted in the ledger while autograd holds it."""

    __slots__ = ("key", "ledger", "tensor")

    def __init__(self, t: torch.Tensor, ledger: StepLedger, key: Any, nbytes: int) -> None:
        self.tensor = t
        self.ledger = ledger
        self.key = key
        ledger.add(key, nbytes)

    def __del__(self) -> None:
        self.ledger.release(self.key)


class _Swapped:
    """A saved activation copied to host memory after forward, back before backward."""

    __slots__ = (
        "__weakref__",
        "compute",
        "dev",
        "device",
        "host",
        "in_event",
        "key_in",
        "key_out",
        "ledger",
        "nbytes",
        "out_event",
        "pending",
        "storage",
        "transfer",
    )

    def __init__(
        self, t: torch.Tensor, ledger: StepLedger, transfer: _Transfer, key: Any, nbytes: int
    ) -> None:
        self.ledger = ledger
        self.transfer = transfer
        self.device = t.device
        self.storage: Any = None  # weakref to the swapped storage, set by the pack hook
        self.nbytes = tensor_bytes(t)
        self.key_out: Any = key
        self.key_in: Any = None
        self.dev: torch.Tensor | None = None
        self.in_event: Any = None
        ledger.add(key, nbytes)
        self.host, self.out_event, self.compute, held = transfer.to_host(t)
        self.pending: torch.Tensor | None = held
        self.poll()

    def poll(self) -> None:
        """Let go of the device tensor once nothing here needs to hold it.

        At once when its release is ordered after the swap-out copy (``pending`` is None),
        otherwise once the copy's event has completed (polled, never waited on).
        """
        if self.key_out is None:
            return
        if self.pending is None or self.out_event is None or self.out_event.query():
            self.pending = None
            self.ledger.release(self.key_out)
            self.key_out = None

    def prefetch(self) -> None:
        """Start the copy back to the device (once)."""
        if self.dev is not None:
            return
        if self.pending is not None:  # the swap-out has not even finished: reuse the original
            self.dev = self.pending
            return
        self.dev, self.in_event = self.transfer.to_device(self.host, self.device, self.compute)
        self.key_in = ("prefetch", id(self))
        self.ledger.add(self.key_in, self.nbytes)

    def fetch(self) -> torch.Tensor:
        """The device tensor, after the compute stream waits for its copy (on the GPU)."""
        self.prefetch()
        if self.in_event is not None:
            self.compute.wait_event(self.in_event)
        assert self.dev is not None
        return self.dev

    def __del__(self) -> None:
        if self.key_out is not None:
            self.ledger.release(self.key_out)
        if self.key_in is not None:
            self.ledger.release(self.key_in)


class _SwappedView:
    """One saved tensor of a swapped storage: how to rebuild it from the storage's bytes."""

    __slots__ = ("dtype", "held", "offset", "size", "stride")

    def __init__(
        self,
        held: _Swapped,
        dtype: torch.dtype,
        offset: int,
        size: torch.Size,
        stride: tuple[int, ...],
    ) -> None:
        self.held = held
        self.dtype = dtype
        self.offset = offset
        self.size = size
        self.stride = stride

    def fetch(self) -> torch.Tensor:
        raw = self.held.fetch()
        view = torch.empty(0, dtype=self.dtype, device=raw.device)
        return view.set_(raw.untyped_storage(), self.offset, self.size, self.stride)


def _unpack(obj: Any) -> torch.Tensor:
    if isinstance(obj, _SwappedView):
        return obj.fetch()
    if isinstance(obj, _Kept):
        return obj.tensor
    return obj  # type: ignore[no-any-return]


def _checkpoint(
    fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], record: RandomRecord
) -> Any:
    """``checkpoint(fn, *args, **kwargs)`` that keeps the arguments' identities.

    ``checkpoint(fn, *args, **kwargs)`` (non-reentrant; the random ops' results of the forward
    are kept in ``record`` and replayed by the recompute, which never touches the process's
    generator) that keeps the
    arguments' identities: checkpoint saves and restores each tensor argument on its own, so
    ``attn(h, h, h)`` would be recomputed as three distinct tensors, and
    ``nn.MultiheadAttention`` takes another path (separate projections) when ``query is key``
    no longer holds. Each distinct tensor is passed once and the call rebuilt from them.
    """
    leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    unique: list[torch.Tensor] = []
    where: dict[int, int] = {}
    slots: list[int] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            slot = where.setdefault(id(leaf), len(unique))
            if slot == len(unique):
                unique.append(leaf)
            slots.append(slot)
        else:
            slots.append(-1)

    def run(*tensors: torch.Tensor) -> Any:
        rebuilt = [tensors[s] if s >= 0 else leaf for s, leaf in zip(slots, leaves, strict=True)]
        a, kw = torch.utils._pytree.tree_unflatten(rebuilt, spec)
        return fn(*a, **kw)

    return torch.utils.checkpoint.checkpoint(
        run,
        *unique,
        use_reentrant=False,
        preserve_rng_state=False,
        context_fn=lambda: (record.recorder(), record.replayer()),
    )


def _once_in_backward(modules: list[nn.Module], fn: Any) -> Any:
    """``fn``, undoing a recompute's second update of the modules' buffers (BatchNorm)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if not _in_backward():
            return fn(*args, **kwargs)
        buffers = [(b, b.clone()) for m in modules for b in m.buffers()]
        try:
            return fn(*args, **kwargs)
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)

    return run


def _in_backward() -> bool:
    return bool(torch._C._current_graph_task_id() != -1)


class PlanHooks:
    """Everything one installed plan attached to a model; ``remove()`` takes it all off."""

    def __init__(
        self,
        model: nn.Module,
        modules: UnitModules,
        profile: StepProfile,
        choices: tuple[Placement, ...],
        ledger: StepLedger,
    ) -> None:
        self.model_ref = weakref.ref(model)
        self.modules = modules
        self.profile = profile
        self.choices = choices
        self.ledger = ledger
        self.transfer = _Transfer()
        self._local = threading.local()
        self._handles: list[Any] = []
        self._wrapped: list[tuple[nn.Module, Any]] = []  # (module, its instance forward or None)
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._swapped: dict[int, list[weakref.ref[_Swapped]]] = {}
        self._pending: list[weakref.ref[_Swapped]] = []
        self._by_storage: weakref.WeakValueDictionary[Any, _Swapped] = weakref.WeakValueDictionary()
        self._forwards = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        model = self.model_ref()
        assert model is not None
        runs = recompute_runs(self.profile, self.choices)
        n = len(self.choices)
        self._run_start = runs
        self._run_end = list(range(n))
        for i in range(n - 1, -1, -1):
            if i + 1 < n and runs[i + 1] == runs[i]:
                self._run_end[i] = self._run_end[i + 1]
        for u, calls in enumerate(self.modules.modules):
            if not calls:
                continue
            first, last = calls[0][1], calls[-1][1]
            self._handles.append(
                first.register_forward_pre_hook(functools.partial(self._unit_pre, u))
            )
            self._handles.append(last.register_forward_hook(functools.partial(self._unit_post, u)))
            if self.choices[u] is not Placement.RECOMPUTE:
                for _name, m in calls:
                    self._handles.append(
                        m.register_forward_pre_hook(functools.partial(self._push, u))
                    )
                    self._handles.append(m.register_forward_hook(self._pop))
            elif runs[u] == u and self._run_end[u] == u:
                for _name, m in calls:
                    self._wrap(m, functools.partial(self._recompute_forward, [m]))
            elif runs[u] == u:  # the first unit of a chained run: one checkpoint for all of it
                members = [
                    m
                    for v in range(u, self._run_end[u] + 1)
                    for _name, m in self.modules.modules[v]
                ]
                self._wrap(members[0], functools.partial(self._run_forward, members))
                for m in members[1:]:
                    self._wrap(m, self._passed_forward)
        self._wrap(model, self._root_forward)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for m, previous in reversed(self._wrapped):
            if previous is None:
                del m.forward
            else:
                m.forward = previous
        self._wrapped.clear()

    def _wrap(self, m: nn.Module, make: Callable[[nn.Module, Any], Any]) -> None:
        previous = m.__dict__.get("forward")
        self._wrapped.append((m, previous))
        m.forward = make(m, m.forward)

    # ------------------------------------------------------------------ forwards
    def _root_forward(self, m: nn.Module, inner: Any) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return inner(*args, **kwargs)
            with self._lock:
                self._forwards += 1
                self._local.forward = self._forwards
            self._local.skip = None  # left over if an earlier forward raised
            self._local.passed = None
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                return inner(*args, **kwargs)

        return forward

    def _recompute_forward(self, modules: list[nn.Module], m: nn.Module, inner: Any) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return inner(*args, **kwargs)
            return _checkpoint(_once_in_backward(modules, inner), args, kwargs, self._record())

        return forward

    def _run_forward(self, members: list[nn.Module], m: nn.Module, inner: Any) -> Any:
        """The first module of a chained recompute run.

        The first module of a chained recompute run: runs the whole run in one checkpoint;
        the ``nn.Sequential`` then calls the others, which pass the run's output through.
        """
        local = self._local
        rest = members[1:]

        def run_all(x: Any) -> Any:
            was = getattr(local, "in_run", False)
            local.in_run = True
            try:
                x = inner(x)
                for other in rest:
                    x = other(x)
                return x
            finally:
                local.in_run = was

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled() or kwargs or len(args) != 1:
                return inner(*args, **kwargs)
            out = _checkpoint(_once_in_backward(members, run_all), args, {}, self._record())
            local.skip = list(rest)
            return out

        return forward

    def _record(self) -> RandomRecord:
        """A record of one checkpoint call's random results, held in the ledger while it lives."""

        def hold(t: torch.Tensor) -> _Kept | None:
            try:
                key = ("device", str(t.device), t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # sparse, nested: not counted
                return None
            return _Kept(t, self.ledger, key, tensor_bytes(t))

        return RandomRecord(hold)

    def _passed_forward(self, m: nn.Module, inner: Any) -> Any:
        local = self._local

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not getattr(local, "in_run", False):
                skip: list[nn.Module] | None = getattr(local, "skip", None)
                if skip and skip[0] is m:
                    skip.pop(0)
                    local.passed = m
                    return args[0]
            return inner(*args, **kwargs)

        return forward

    def _passing(self, module: nn.Module, post: bool) -> bool:
        """Whether this call of ``module`` only passes a run's output through."""
        local = self._local
        if post:
            if getattr(local, "passed", None) is module:
                local.passed = None
                return True
            return False
        skip: list[nn.Module] | None = getattr(local, "skip", None)
        if not skip or getattr(local, "in_run", False):
            return False
        return skip[0] is module

    # ------------------------------------------------------------------ unit tracking
    def _stack(self) -> list[int]:
        stack: list[int] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = []
            self._local.stack = stack
        return stack

    def _push(self, u: int, module: nn.Module, args: Any) -> None:
        self._stack().append(u)

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        stack = self._stack()
        if stack:
            stack.pop()

    def _unit_pre(self, u: int, module: nn.Module, args: Any) -> None:
        """At a unit's forward start: hook its input's gradient (= the unit's backward end)."""
        if not torch.is_grad_enabled() or _in_backward() or self._passing(module, False):
            return
        key = ("recompute", getattr(self._local, "forward", 0), u)
        for t in iter_tensors(args):
            if t.requires_grad:
                t.register_hook(lambda _g, key=key: self._unit_backward_end(key))  # type: ignore[no-untyped-call]
                return

    def _unit_post(self, u: int, module: nn.Module, args: Any, output: Any) -> None:
        """At a unit's forward end: hook its output's gradient (= the unit's backward start)."""
        if not torch.is_grad_enabled() or _in_backward() or self._passing(module, True):
            return
        forward = getattr(self._local, "forward", 0)
        for t in iter_tensors(output):
            if t.requires_grad:
                t.register_hook(  # type: ignore[no-untyped-call]
                    lambda _g, u=u, forward=forward: self._unit_backward_start(u, forward)
                )
                return

    def _unit_backward_start(self, u: int, forward: int) -> None:
        # The next unit's backward has ended when this one's begins (both hooks sit on the
        # same tensor, this one registered first): release its recompute transient first.
        self._unit_backward_end(("recompute", forward, u + 1))
        for j in (u, u - 1):
            if j >= 0 and self.choices[j] is Placement.SWAP:
                for ref in self._swapped.pop(j, []):
                    held = ref()
                    if held is not None:
                        held.prefetch()
        if self.choices[u] is Placement.RECOMPUTE and self._run_end[u] == u:
            # The run's last unit: its backward recomputes the whole run. Each unit's share is
            # released when the unit before begins its backward, or at the end of backward
            # (releasing twice is harmless).
            engine = torch.autograd.Variable._execution_engine
            for v in range(self._run_start[u], u + 1):
                key = ("recompute", forward, v)
                self.ledger.add(key, self.profile.units[v].saved_bytes)
                engine.queue_callback(functools.partial(self._unit_backward_end, key))

    def _unit_backward_end(self, key: Any) -> None:
        self.ledger.release(key)

    # ------------------------------------------------------------------ saved tensors
    def _pack(self, t: torch.Tensor) -> Any:
        try:
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # sparse, nested: left alone
            return t
        if ptr == 0 or ptr in self._params:
            return t
        self._poll()
        stack = self._stack()
        u = stack[-1] if stack else -1
        key = ("device", str(t.device), ptr)
        if u >= 0 and self.choices[u] is Placement.SWAP and t.layout is torch.strided:
            # One host copy per storage however many views of it are saved (q, k and v of
            # one projection; conv2 saving relu's output): the whole storage, as profiled.
            found = self._by_storage.get(key)
            if found is None or found.storage() is not storage:
                raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                found = _Swapped(raw, self.ledger, self.transfer, key, nbytes)
                found.storage = weakref.ref(storage)
                self._by_storage[key] = found
                ref = weakref.ref(found)
                self._swapped.setdefault(u, []).append(ref)
                if found.pending is not None:
                    self._pending.append(ref)
            return _SwappedView(found, t.dtype, int(t.storage_offset()), t.size(), t.stride())
        return _Kept(t, self.ledger, key, nbytes)

    def _poll(self) -> None:
        if not self._pending:
            return
        alive = []
        for ref in self._pending:
            held = ref()
            if held is not None:
                held.poll()
                if held.pending is not None:
                    alive.append(ref)
        self._pending = alive
