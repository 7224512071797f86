"""Any model's forward run on HFTA's layout, node by node, without vmap where it can.

HFTA (Wang et al., MLSys 2021, arXiv:2102.02344) keeps the activations of K fused models in
one layout, ``(N, K*C, *S)``, from layer to layer: a grouped convolution, BatchNorm over K*C
channels, pooling and every elementwise operator read it as it is. The direct path
(``_direct.py``) does this for an ``nn.Sequential``, whose forward is its layers in order.
This module does it for a model whose forward is a graph (a ResNet's residual blocks): the
forward is traced once per train/eval mode with ``torch.fx`` (the user's code, unchanged), and
each node runs on the array: layers with a direct form directly, other ``torch.nn`` layers
through vmap, and the few functions known to act element by element (``+``, ``*``, ``relu``,
``torch.flatten(x, 1)``...) on whatever layout their inputs share.

A forward that does not trace, or whose graph holds anything else (a method call on a tensor,
a parameter read outside a layer, another function), is not run here: the fused module then
runs it whole under vmap, as before. The trace itself records what the forward did with
Python values; control flow on them is fixed by the structure key, which describes every
attribute a forward may read. The trace is taken at the first forward in each train/eval
mode: an attribute of ``fused.stacked`` (the fused module's own copy) changed by hand after
that is not seen.
"""

from __future__ import annotations

from collections.abc import Callable
import operator
from typing import Any

import torch
from torch import fx
from torch import nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from waterwave_hpo.fusion._direct import Layout
from waterwave_hpo.fusion._direct import channels
from waterwave_hpo.fusion._direct import direct_form
from waterwave_hpo.fusion._direct import flatten
from waterwave_hpo.fusion._direct import stacked

_ELEMENTWISE_BINARY: frozenset[Callable[..., Any]] = frozenset(
    {
        operator.add,
        operator.sub,
        operator.mul,
        operator.truediv,
        torch.add,
        torch.mul,
    }
)
"""Functions of two operands that act element by element (with broadcasting)."""

_ELEMENTWISE_UNARY: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.relu,
        F.relu,
        F.relu6,
        F.gelu,
        F.silu,
        F.hardswish,
        F.hardsigmoid,
        torch.sigmoid,
        torch.tanh,
        F.sigmoid,
        F.tanh,
    }
)
"""Functions of one tensor (and Python options) that act element by element."""


_INPLACE: dict[Callable[..., Any], Callable[..., Any]] = {
    operator.iadd: operator.add,
    operator.isub: operator.sub,
    operator.imul: operator.mul,
    operator.itruediv: operator.truediv,
}
"""``x += y`` and kin, and the operator each computes. fx's own proxy records ``x += y`` as
``x + y``; here it stays in place, so a tensor that aliases ``x`` sees the change as it does
when the model runs alone."""


class _Proxy(fx.Proxy):
    """An fx proxy that records in-place arithmetic as such (see ``_INPLACE``)."""

    def _inplace(self, op: Callable[..., Any], other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", op, (self, other), {})  # type: ignore[no-any-return,unused-ignore]

    def __iadd__(self, other: Any) -> fx.Proxy:
        return self._inplace(operator.iadd, other)

    def __isub__(self, other: Any) -> fx.Proxy:
        return self._inplace(operator.isub, other)

    def __imul__(self, other: Any) -> fx.Proxy:
        return self._inplace(operator.imul, other)

    def __itruediv__(self, other: Any) -> fx.Proxy:
        return self._inplace(operator.itruediv, other)


class _Tracer(fx.Tracer):
    """Keeps every layer with a direct form (the fused kernels included) a leaf."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return direct_form(m) is not None or super().is_leaf_module(m, module_qualified_name)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)


def _supported(graph: fx.Graph, root: nn.Module) -> bool:
    """Whether every node of ``graph`` runs here (else the model runs whole under vmap)."""
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_module":
            continue
        if node.op == "call_function" and node.target in _ELEMENTWISE_BINARY:
            continue
        if node.op == "call_function" and node.target in _INPLACE:
            continue
        if node.op == "call_function" and node.target in _ELEMENTWISE_UNARY:
            continue
        if node.op == "call_function" and node.target is torch.flatten:
            continue
        return False
    return True


def trace(root: nn.Module) -> fx.Graph | None:
    """The forward of ``root`` (the stacked model) as a graph this module runs, or None."""
    try:
        graph = _Tracer().trace(root)
    except Exception:  # any failure to trace: the model runs under vmap
        return None
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1 or not _supported(graph, root):
        return None
    return graph


Value = tuple[Any, Layout | None]
"""A node's value and its layout (None for what is not an activation: a Python number)."""


def _to_stacked(value: Value, k: int) -> torch.Tensor | Any:
    x, layout = value
    return x if layout is None else stacked(x, layout, k)


def _binary(fn: Callable[..., Any], a: Value, b: Value, k: int) -> Value:
    """``fn(a, b)`` for every model, in a layout both share where one fits."""
    (x, lx), (y, ly) = a, b
    if lx is None or ly is None:  # a Python number: the tensor's layout holds
        return fn(x, y), lx or ly
    if lx is ly and (lx is not Layout.CHANNELS or x.shape == y.shape):
        if lx is Layout.STACKED and x.dim() != y.dim():
            # Align the trailing dims, as each model alone broadcasts them.
            if x.dim() < y.dim():
                x = x.view(k, *([1] * (y.dim() - x.dim())), *x.shape[1:])
            else:
                y = y.view(k, *([1] * (x.dim() - y.dim())), *y.shape[1:])
        return fn(x, y), lx
    return _binary(fn, (stacked(x, lx, k), Layout.STACKED), (stacked(y, ly, k), Layout.STACKED), k)


def _inplace(op: Callable[..., Any], pure: Callable[..., Any], a: Value, b: Value, k: int) -> Value:
    """``a op= b`` on ``a``'s own tensor, as the model alone does (tensors aliasing it see it).

    ``b`` is brought to ``a``'s layout. Where ``a``'s tensor cannot hold the result in its
    layout (a shared ``a`` and a per-model ``b``, or shapes that broadcast only per model), the
    result is computed out of place, as ``_binary``; it then differs from the model alone only
    if the forward reads ``a`` again through another name, which the verification
    (``fuse(..., example_inputs=...)``) would show.
    """
    (x, lx), (y, ly) = a, b
    if lx is None:
        return _binary(pure, a, b, k)
    if ly is None or ly is lx:
        same = ly is None or lx is not Layout.CHANNELS or x.shape == y.shape
        if same and (lx is not Layout.STACKED or ly is None or x.dim() >= y.dim()):
            if lx is Layout.STACKED and ly is not None and x.dim() > y.dim():
                y = y.view(k, *([1] * (x.dim() - y.dim())), *y.shape[1:])
            return op(x, y), lx
    elif lx is Layout.STACKED:
        ys = stacked(y, ly, k)
        if ys.dim() <= x.dim():
            ys = ys.view(k, *([1] * (x.dim() - ys.dim())), *ys.shape[1:])
            return op(x, ys), lx
    elif lx is Layout.CHANNELS:
        ys = stacked(y, ly, k)
        if ys.dim() == x.dim() + 1 and ys.shape[2:] == x.shape[2:] and ys.shape[1] == x.shape[0]:
            return op(x, channels(y, ly, k)), lx
    return _binary(pure, a, b, k)


def run(
    graph: fx.Graph,
    root: nn.Module,
    x: torch.Tensor,
    layout: Layout,
    k: int,
    vmap_module: Callable[[nn.Module, tuple[Any, ...], dict[str, Any], bool], Any],
) -> Any:
    """Run ``graph`` (traced from ``root``) on input ``x`` of the K models.

    Args:
        graph: What :func:`trace` returned for ``root``.
        root: The stacked model (parameters ``(K, ...)``).
        x: The input, shared ``(B, ...)`` or stacked ``(K, B, ...)``.
        layout: ``Layout.SHARED`` or ``Layout.STACKED``.
        k: K.
        vmap_module: Runs one layer through vmap: ``(layer, inputs, kwargs, shared)``, its
            output ``(K, ...)``.

    Returns:
        The model's output for the K models, each tensor ``(K, B, ...)``.
    """
    env: dict[fx.Node, Value] = {}

    def value_of(arg: Any) -> Value:
        if isinstance(arg, fx.Node):
            return env[arg]
        return arg, None

    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = (x, layout)
        elif node.op == "call_module":
            module = root.get_submodule(str(node.target))
            form = direct_form(module)
            args = [value_of(a) for a in node.args]
            result = None
            if form is not None and len(args) == 1 and not node.kwargs and args[0][1] is not None:
                result = form(module, args[0][0], args[0][1], k)
            if result is None:
                values = [*args, *(value_of(v) for v in node.kwargs.values())]
                shared = all(lay in (Layout.SHARED, None) for _, lay in values)
                inputs = tuple(a if shared else _to_stacked((a, lay), k) for a, lay in args)
                kwargs = {
                    name: (v if shared else _to_stacked((v, lay), k))
                    for name, (v, lay) in zip(
                        node.kwargs, (value_of(v) for v in node.kwargs.values()), strict=True
                    )
                }
                out = vmap_module(module, inputs, kwargs, shared)
                result = (out, Layout.STACKED)
            env[node] = result
        elif node.op == "call_function" and node.target in _ELEMENTWISE_BINARY:
            fn = node.target
            a, b = (value_of(v) for v in node.args[:2])
            if node.kwargs or len(node.args) != 2:
                raise AssertionError("traced elementwise call with extra arguments")
            env[node] = _binary(fn, a, b, k)
        elif node.op == "call_function" and node.target in _INPLACE:
            a, b = (value_of(v) for v in node.args[:2])
            env[node] = _inplace(node.target, _INPLACE[node.target], a, b, k)
        elif node.op == "call_function" and node.target in _ELEMENTWISE_UNARY:
            (t, lay), *rest = (value_of(v) for v in node.args)
            fn = node.target
            env[node] = (fn(t, *(r for r, _ in rest), **node.kwargs), lay)
        elif node.op == "call_function" and node.target is torch.flatten:
            (t, lay), *rest = (value_of(v) for v in node.args)
            options = [r for r, _ in rest]
            start = options[0] if options else node.kwargs.get("start_dim", 0)
            end = options[1] if len(options) > 1 else node.kwargs.get("end_dim", -1)
            if lay is None:
                raise AssertionError("torch.flatten of a value that is not an activation")
            layer = nn.Flatten(start, end)
            done = flatten(layer, t, lay, k)
            assert done is not None
            env[node] = done
        elif node.op == "output":
            out = value_of(node.args[0]) if isinstance(node.args[0], fx.Node) else None
            if out is not None:
                return _to_stacked(out, k)
            return pytree.tree_map(
                lambda a: _to_stacked(env[a], k) if isinstance(a, fx.Node) else a, node.args[0]
            )
    raise AssertionError("graph without output")
