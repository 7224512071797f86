"""The profiling pass: sizes and times of a model's contiguous pieces, from one training step.

One forward (and, when it follows, its backward) is observed with module hooks and
``torch.autograd.graph.saved_tensors_hooks``; nothing about the computation changes (the hooks
return ``None`` and the pack hook returns its tensor), so that step's losses and gradients are
those of the bare model.

Where the model can be cut. A cut sits before a module call whose only gradient-carrying input
is one tensor ``x`` and which runs once per forward. It is valid when ``x`` is *all* that
crosses it: walking the autograd graph back from the model's outputs, without passing through
``x``, reaches no output of a module call that ended before the cut. A residual block's inner
cuts fail this test (the skip tensor crosses), so the block stays whole; the cuts between blocks
pass. The test runs on the real graph, so it needs no ``torch.fx`` trace and sees data-dependent
control flow as it ran. Without a graph (every parameter frozen) only the children of
``nn.Sequential`` containers nested in ``nn.Sequential`` from the root are cut.

Not seen by the test: tensors that carry no gradient (the raw batch, masks, position ids)
crossing a cut. They are inputs the user owns, not activations the groups reserve, so a cut
they cross is still correct for the ledger; e.g. a lone residual block fed the raw batch is cut
inside, since only the batch itself skips.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field
import time
from typing import Any

import torch
from torch import nn

from waterwave_hpo.nodegroup._group import NodeGroup
from waterwave_hpo.nodegroup._hooks import ModuleObserver
from waterwave_hpo.nodegroup._partition import partition


def iter_tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors in ``obj`` (a tensor, or tuples/lists/dicts of them), depth-first."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 6 and isinstance(obj, (tuple, list)):
        for item in obj:
            yield from iter_tensors(item, depth + 1)
    elif depth < 6 and isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item, depth + 1)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements (``numel * element_size``)."""
    return t.numel() * t.element_size()


class StepClock:
    """Timestamps of the profiled step, without a device-wide ``torch.cuda.synchronize``.

    On CUDA a mark is a timing event recorded on the current stream of the model's device: in
    the trial's thread that is the trial's stream; in a backward hook (autograd's device thread)
    it is the stream the forward op ran on, which autograd makes current for the op's backward.
    Nothing waits while marking (a backward hook must never block: it would stall every
    co-hosted trial's backward on that thread). Durations are read once, after the step, by
    waiting on the last event only (``cudaEventSynchronize``). On the CPU a mark is
    ``time.perf_counter()``.

    Args:
        device: The model's device; CUDA events only for a ``cuda`` device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        """A timestamp now, in stream order on CUDA."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))  # type: ignore[no-untyped-call,unused-ignore]
        return event

    def seconds(self, begin: Any, end: Any) -> float:
        """Seconds from mark ``begin`` to mark ``end`` (waits for ``end`` on CUDA)."""
        if not self.cuda:
            return float(end - begin)
        end.synchronize()
        return float(begin.elapsed_time(end)) / 1e3


def _model_device(model: nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


@dataclass
class _Call:
    index: int
    name: str
    module: nn.Module
    parent: int
    start_event: int
    t_start: Any
    grad_input: torch.Tensor | None
    n_grad_inputs: int
    input_bytes: int
    end_event: int = -1
    end_index: int = -1
    out_nodes: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class Atom:
    """The smallest piece the partition works with: from one valid cut to the next.

    Attributes:
        start: Index (in call order) of the module call the piece begins with.
        end: Index of the call the next piece begins with (number of calls for the last).
        module: The module whose forward pre-hook is the piece's gate.
        saved_bytes: Bytes saved for backward inside it.
        output_bytes: Bytes it hands on.
        forward_s: Forward seconds.
    """

    start: int
    end: int
    module: nn.Module
    saved_bytes: int
    output_bytes: int
    forward_s: float


class Profiler(ModuleObserver):
    """Observes one training step of ``model`` (forward with grad enabled, then backward).

    ``install()`` then run the step; the first forward with grad enabled is profiled (forwards
    under ``torch.no_grad()`` are ignored). ``ready`` turns true when that forward ended;
    ``atoms()`` and ``groups(k)`` then describe the model.
    """

    def __init__(self, model: nn.Module, clock: StepClock | None = None) -> None:
        super().__init__(model)
        self._clock_given = clock is not None
        self.clock = clock if clock is not None else StepClock(_model_device(model))
        self._names: dict[int, str] = {}
        for name, m in model.named_modules():
            self._names.setdefault(id(m), name)
        self._param_keys = {
            p.untyped_storage().data_ptr() for p in model.parameters() if p.numel() > 0
        }
        self._calls: list[_Call] = []
        self._stack: list[int] = []
        self._events = 0
        self._saved: dict[tuple[int, str], tuple[int, int]] = {}
        self._active = False
        self._saved_hooks: Any = None
        self.ready = False
        self._atoms: tuple[Atom, ...] = ()
        self._output_bytes = 0
        self._t_end_forward: Any = None
        self._bw_times: dict[int, Any] = {}
        self._bw_start: Any = None
        self._bw_end: Any = None

    # ------------------------------------------------------------------ hooks
    # install() and remove(): ModuleObserver's, on every module of the model.
    def _leave(self) -> None:
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None

    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a checkpointed forward re-run inside backward is not the profiled step
        if module is self.model:
            if self.ready:
                return
            if self._active:  # the previous profiled forward raised: start over
                self._leave()
                self._calls.clear()
                self._saved.clear()
                self._stack.clear()
            if not torch.is_grad_enabled():
                return
            self._active = True
            if not self._clock_given:  # the model may have moved since pipeline(model)
                self.clock = StepClock(_model_device(self.model))
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            self._saved_hooks.__enter__()
        elif not self._active:
            return
        tensors = list(iter_tensors((args, kwargs)))
        grad_inputs = [t for t in tensors if t.requires_grad]
        self._events += 1
        call = _Call(
            index=len(self._calls),
            name=self._names.get(id(module), type(module).__name__),
            module=module,
            parent=self._stack[-1] if self._stack else -1,
            start_event=self._events,
            t_start=self.clock.mark(),
            grad_input=grad_inputs[0] if len(grad_inputs) == 1 else None,
            n_grad_inputs=len(grad_inputs),
            input_bytes=sum(tensor_bytes(t) for t in tensors),
        )
        self._calls.append(call)
        self._stack.append(call.index)

    def _post(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        if not self._active or not self._stack:
            return
        call = self._calls[self._stack.pop()]
        self._events += 1
        call.end_event = self._events
        call.end_index = len(self._calls)
        outputs = list(iter_tensors(output))
        call.out_nodes = [t.grad_fn for t in outputs if t.grad_fn is not None]
        if module is self.model:
            self._t_end_forward = self.clock.mark()
            self._output_bytes = sum(tensor_bytes(t) for t in outputs)
            self._leave()
            self._active = False
            self._finish_forward(outputs)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._active:
            try:
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                nbytes = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # sparse, nested, meta-like tensors
                return t
            key = (ptr, str(t.device))
            if ptr != 0 and ptr not in self._param_keys and key not in self._saved:
                self._saved[key] = (len(self._calls) - 1, nbytes)
        return t

    # ------------------------------------------------------------------ cuts
    def _finish_forward(self, outputs: list[torch.Tensor]) -> None:
        roots = [t.grad_fn for t in outputs if t.grad_fn is not None]
        counts = Counter(id(c.module) for c in self._calls)
        candidates = [
            c
            for c in self._calls
            if c.index == 0 or (counts[id(c.module)] == 1 and c.n_grad_inputs <= 1)
        ]
        valid = self._graph_cuts(candidates, roots) if roots else self._sequential_cuts(candidates)
        cuts = self._merge_empty(valid)
        self._atoms = self._make_atoms(cuts)
        if roots:
            self._install_backward_timers(cuts, outputs)
        for c in self._calls:  # drop graph references held by the profile
            c.out_nodes = []
            c.grad_input = None
        self.ready = True
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _graph_cuts(self, candidates: list[_Call], roots: list[Any]) -> list[_Call]:
        ended = sorted((c for c in self._calls if c.end_event >= 0), key=lambda c: c.end_event)
        markers: set[int] = set()
        alive: list[Any] = []
        pos = 0
        valid = []
        for cand in candidates:
            while pos < len(ended) and ended[pos].end_event < cand.start_event:
                for node in ended[pos].out_nodes:
                    markers.add(id(node))
                    alive.append(node)
                pos += 1
            if cand.index == 0 or not markers:
                valid.append(cand)
                continue
            blocked = cand.grad_input.grad_fn if cand.grad_input is not None else None
            if not _reaches(roots, blocked, markers):
                valid.append(cand)
        return valid

    def _sequential_cuts(self, candidates: list[_Call]) -> list[_Call]:
        valid = []
        for cand in candidates:
            ok = True
            p = cand.parent
            while p >= 0:
                if not isinstance(self._calls[p].module, nn.Sequential):
                    ok = False
                    break
                p = self._calls[p].parent
            if ok:
                valid.append(cand)
        return valid

    def _merge_empty(self, valid: list[_Call]) -> list[_Call]:
        """Drop a cut when no module call ends between it and the cut before it."""
        kept: list[_Call] = []
        for cand in valid:
            if kept:
                prev = kept[-1].index
                if not any(
                    prev <= c.index and 0 <= c.end_index <= cand.index
                    for c in self._calls[prev : cand.index]
                ):
                    continue
            kept.append(cand)
        return kept

    def _make_atoms(self, cuts: list[_Call]) -> tuple[Atom, ...]:
        saved = [0] * len(cuts)
        starts = [c.index for c in cuts]
        for position, nbytes in self._saved.values():
            a = 0
            while a + 1 < len(starts) and starts[a + 1] <= position:
                a += 1
            saved[a] += nbytes
        atoms = []
        for a, c in enumerate(cuts):
            if a + 1 < len(cuts):
                nxt = cuts[a + 1]
                end, t_end, out_bytes = nxt.index, nxt.t_start, nxt.input_bytes
            else:
                end, t_end, out_bytes = len(self._calls), self._t_end_forward, self._output_bytes
            forward_s = self.clock.seconds(c.t_start, t_end)
            atoms.append(Atom(c.index, end, c.module, saved[a], out_bytes, forward_s))
        return tuple(atoms)

    def _install_backward_timers(self, cuts: list[_Call], outputs: list[torch.Tensor]) -> None:
        # These run on autograd's device thread on CUDA: they only record marks, never wait.
        def at_end() -> None:
            self._bw_end = self.clock.mark()

        def at_start(_grad: torch.Tensor) -> None:
            if self._bw_start is None:
                self._bw_start = self.clock.mark()
                torch.autograd.Variable._execution_engine.queue_callback(at_end)

        for t in outputs:
            if t.requires_grad:
                t.register_hook(at_start)  # type: ignore[no-untyped-call]
        for a, cut in enumerate(cuts):
            x = cut.grad_input
            if x is None or a == 0:
                continue

            def record(grad: torch.Tensor, a: int = a) -> None:
                if a not in self._bw_times:
                    self._bw_times[a] = self.clock.mark()

            x.register_hook(record)  # type: ignore[no-untyped-call]

    # ------------------------------------------------------------------ results
    def atoms(self) -> tuple[Atom, ...]:
        """The pieces between valid cuts, in execution order (after the profiled forward)."""
        return self._atoms

    def backward_s(self) -> list[float]:
        """Per atom, backward seconds of the profiled step (0.0 where not observed)."""
        n = len(self._atoms)
        if self._bw_start is None:
            return [0.0] * n
        end = self._bw_end if self._bw_end is not None else self._bw_start
        out = []
        for a in range(n):
            finished = self._bw_times.get(a, end) if a > 0 else end
            began = self._bw_times.get(a + 1, self._bw_start) if a + 1 < n else self._bw_start
            out.append(max(0.0, self.clock.seconds(began, finished)))
        return out

    def atom_modules(self) -> tuple[tuple[tuple[str, nn.Module], ...], ...]:
        """Per atom, the outermost module calls whose whole call lies in it, in call order.

        Each entry is ``(qualified name, module)``. Work outside every module call (functional
        ops in a parent's ``forward``) belongs to no entry. Used by the memory planner
        (``waterwave_hpo.planning``) to wrap an atom's computation.
        """
        return tuple(
            tuple((c.name, c.module) for c in self._outermost(a.start, a.end)) for a in self._atoms
        )

    def groups(self, k: int) -> tuple[tuple[NodeGroup, ...], tuple[nn.Module, ...]]:
        """Cut the atoms into ``k`` groups of least largest ``saved_bytes``.

        Returns:
            The groups and, per group, the module whose forward pre-hook is its gate.
        """
        atoms = self._atoms
        cut = partition([a.saved_bytes for a in atoms], k)
        backward = self.backward_s()
        seen_params: set[int] = set()
        groups = []
        entries = []
        for g, part in enumerate(cut.slices()):
            members = atoms[part]
            start, end = members[0].start, members[-1].end
            outer = self._outermost(start, end)
            param_bytes = grad_bytes = 0
            for call in outer:
                for p in call.module.parameters():
                    if id(p) in seen_params:
                        continue
                    seen_params.add(id(p))
                    param_bytes += tensor_bytes(p)
                    if p.requires_grad:
                        grad_bytes += tensor_bytes(p)
            groups.append(
                NodeGroup(
                    index=g,
                    modules=tuple(c.name for c in outer),
                    saved_bytes=sum(a.saved_bytes for a in members),
                    output_bytes=members[-1].output_bytes,
                    param_bytes=param_bytes,
                    grad_bytes=grad_bytes,
                    forward_s=sum(a.forward_s for a in members),
                    backward_s=sum(backward[part]),
                )
            )
            entries.append(members[0].module)
        return tuple(groups), tuple(entries)

    def _outermost(self, start: int, end: int) -> list[_Call]:
        out: list[_Call] = []
        for c in self._calls[start:end]:
            if c.end_index < 0 or c.end_index > end:
                continue
            if out and c.index < out[-1].end_index:
                continue  # nested in one already taken
            out.append(c)
        return out


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _reaches(roots: list[Any], blocked: Any, markers: set[int]) -> bool:
    """Whether the graph from ``roots``, not passing through ``blocked``, reaches a marker."""
    stack = [r for r in roots if r is not blocked]
    seen: set[int] = {id(r) for r in stack}
    alive = list(stack)
    while stack:
        node = stack.pop()
        if id(node) in markers:
            return True
        for nxt, _ in node.next_functions:
            if nxt is None or nxt is blocked or id(nxt) in seen:
                continue
            seen.add(id(nxt))
            alive.append(nxt)
            stack.append(nxt)
    return False
