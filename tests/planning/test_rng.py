"""A recomputed unit's random numbers under co-hosting: its forward's, and nobody else's moved.

A "neighbour" thread stands for a co-hosted trial drawing from the process's generator. In the
deterministic tests it draws exactly when asked: inside each dropout's forward (between the
checkpoint's start and the unit's own draw, the interleaving that broke recompute) and inside
the recompute; in the last test it draws freely in a loop, as the issue's report.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import threading

import pytest
import torch
from torch import nn
import torch.utils.checkpoint

import waterwave_hpo as ww
from waterwave_hpo.planning import RecomputeMismatchError
from waterwave_hpo.planning import plan_of
from waterwave_hpo.planning._rng import RandomRecord

STEPS = 12


class Neighbour:
    """Another thread's trial: draws ``torch.rand(64)`` from the shared generator on request."""

    def __init__(self) -> None:
        self.draws: list[torch.Tensor] = []
        self._asked = threading.Semaphore(0)
        self._done = threading.Semaphore(0)
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._asked.acquire()
            if self._stop:
                return
            self.draws.append(torch.rand(64))
            self._done.release()

    def draw_now(self) -> None:
        """Have the neighbour draw once, in its own thread, and wait until it has."""
        self._asked.release()
        self._done.acquire()

    def stop(self) -> None:
        self._stop = True
        self._asked.release()
        self._thread.join()


def _in_backward() -> bool:
    return bool(torch._C._current_graph_task_id() != -1)


class RecordingDropout(nn.Module):
    """``nn.Dropout`` that records its mask: in forward and, separately, in a recompute."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.neighbour: Neighbour | None = None
        self.draw_in_recompute = True
        self.forward_masks: list[torch.Tensor] = []
        self.recompute_masks: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recompute = _in_backward()
        if self.neighbour is not None and (self.draw_in_recompute or not recompute):
            self.neighbour.draw_now()
        out = nn.functional.dropout(x, self.p, self.training)
        (self.recompute_masks if recompute else self.forward_masks).append(out != 0)
        return out


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(32, 32), nn.Tanh(), RecordingDropout(0.5)) for _ in range(4)),
        nn.Linear(32, 4),
    )


def _dropouts(model: nn.Module) -> list[RecordingDropout]:
    return [m for m in model.modules() if isinstance(m, RecordingDropout)]


def _planned(model: nn.Module) -> nn.Module:
    batch = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    ww.fit_memory(model, 1 << 30, example_input=batch, planner="checkpoint_sqrt")
    assert "recompute" in plan_of(model).choices.values()
    for d in _dropouts(model):
        d.forward_masks.clear()
        d.recompute_masks.clear()
    return model


def _steps(model: nn.Module, steps: int = STEPS) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    grads = []
    # without early stop a recompute runs the unit to its end, so RecordingDropout records
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        for _ in range(steps):
            x = torch.randn(8, 32, generator=generator)
            model.zero_grad()
            model(x).square().mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
    return grads


@contextlib.contextmanager
def _neighbour_beside(model: nn.Module, draw_in_recompute: bool = True) -> Iterator[Neighbour]:
    neighbour = Neighbour()
    for d in _dropouts(model):
        d.neighbour = neighbour
        d.draw_in_recompute = draw_in_recompute
    try:
        yield neighbour
    finally:
        neighbour.stop()
        for d in _dropouts(model):
            d.neighbour = None


def _recomputed_masks_match(model: nn.Module) -> int:
    compared = 0
    for d in _dropouts(model):
        if d.recompute_masks:  # a recomputed dropout: once per step, in backward
            assert len(d.recompute_masks) == len(d.forward_masks)
            for seen, again in zip(d.forward_masks, d.recompute_masks, strict=True):
                assert torch.equal(seen, again), "a recompute drew another dropout mask"
                compared += 1
    return compared


@pytest.mark.parametrize("draw_in_recompute", [False, True])
def test_a_recomputed_dropout_sees_its_forwards_mask_while_a_neighbour_draws(
    draw_in_recompute: bool,
) -> None:
    model = _planned(_model())
    with _neighbour_beside(model, draw_in_recompute):
        _steps(model)
    assert _recomputed_masks_match(model) >= STEPS  # at least one recomputed unit, every step


def test_a_recompute_does_not_rewind_the_neighbours_random_stream() -> None:
    model = _planned(_model())
    with _neighbour_beside(model) as neighbour:
        _steps(model)
    draws = torch.stack(neighbour.draws)
    assert len(draws) > 4 * STEPS  # it drew in forwards and in recomputes
    # a restored generator hands the neighbour numbers it had already drawn
    assert len(torch.unique(draws, dim=0)) == len(draws)


def test_planned_gradients_equal_the_unplanned_models_beside_the_same_neighbour() -> None:
    # the neighbour draws at the same points of every forward in both runs, so the bare model
    # and the planned one see the same masks; recomputing must not change one gradient
    bare = _model()
    torch.manual_seed(5)
    with _neighbour_beside(bare, draw_in_recompute=False):
        expected = _steps(bare)
    planned = _planned(_model())
    torch.manual_seed(5)
    with _neighbour_beside(planned, draw_in_recompute=False):
        got = _steps(planned)
    for step_expected, step_got in zip(expected, got, strict=True):
        for a, b in zip(step_expected, step_got, strict=True):
            assert torch.equal(a, b)


def test_with_a_thread_drawing_in_a_loop_no_recomputed_mask_differs() -> None:
    # the report's set-up: a second thread calling torch.rand in a loop, 30 steps
    model = _planned(_model())
    stop = threading.Event()

    def draw() -> None:
        while not stop.is_set():
            torch.rand(256)

    thread = threading.Thread(target=draw, daemon=True)
    thread.start()
    try:
        _steps(model, 30)
    finally:
        stop.set()
        thread.join()
    assert _recomputed_masks_match(model) >= 30


def test_recompute_units_keep_their_random_results_and_the_plan_counts_them() -> None:
    model = _planned(_model())
    profile = ww.planning.step_profile_of(model)
    choices = list(plan_of(model).choices.values())
    random_units = [u for u in profile.units if u.random_bytes > 0]
    assert random_units  # the dropouts' noise (the CPU fills a float buffer: 8 * 32 * 4 bytes)
    assert all(u.random_bytes % (8 * 32 * 4) == 0 for u in random_units)
    ledger = ww.planning.memory_ledger(model)
    ledger.reset_peak()
    _steps(model, 1)
    assert ledger.current_bytes == 0  # every kept random result is let go after backward
    assert ledger.peak_bytes + profile.static_bytes <= plan_of(model).predicted_peak_bytes
    assert "recompute" in choices


def test_a_recompute_that_draws_other_random_ops_than_its_forward_raises() -> None:
    record = RandomRecord()
    with record.recorder():
        torch.rand(3)
    with pytest.raises(RecomputeMismatchError, match="random op"), record.replayer():
        torch.randn(3)


def test_replay_returns_the_recorded_numbers_for_functional_in_place_and_out_ops() -> None:
    record = RandomRecord()
    out_buffer = torch.empty(5)
    with record.recorder():
        a = torch.rand(4)
        b = torch.empty(6).bernoulli_(0.5)
        torch.randn(5, out=out_buffer)
        c = out_buffer.clone()
    torch.rand(100)  # the generator moves on
    state = torch.get_rng_state()
    for _ in range(2):  # a second backward (retain_graph=True) replays again
        again_out = torch.empty(5)
        with record.replayer():
            a2 = torch.rand(4)
            b2 = torch.empty(6).bernoulli_(0.5)
            torch.randn(5, out=again_out)
        assert torch.equal(a, a2) and torch.equal(b, b2) and torch.equal(c, again_out)
        a2.add_(1)  # mutating a replayed result leaves the record intact
    assert torch.equal(torch.get_rng_state(), state)  # the replay drew nothing


class PrivateDropout(nn.Module):
    """Dropout drawing from its own generator (the demo's per-trial recipe, ``SeededDropout``)."""

    def __init__(self, p: float, seed: int) -> None:
        super().__init__()
        self.p = p
        self.generator = torch.Generator().manual_seed(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.empty_like(x).bernoulli_(1 - self.p, generator=self.generator)
        return x * keep / (1 - self.p)


def test_a_recomputed_unit_drawing_from_its_own_generator_gets_its_forwards_mask() -> None:
    # checkpoint's preserve_rng_state restores only the default generators: a recompute drew
    # the next numbers of a private generator, not the forward's (and advanced it twice a step)
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(
            *(
                nn.Sequential(nn.Linear(32, 32), nn.Tanh(), PrivateDropout(0.5, i))
                for i in range(4)
            ),
            nn.Linear(32, 4),
        )

    bare = build()
    expected = _steps(bare, 4)
    planned = build()
    _planned(planned)
    # profiling drew from the private generators: reset them as the bare model's were
    for module, seed in zip(
        [m for m in planned.modules() if isinstance(m, PrivateDropout)], range(4), strict=True
    ):
        module.generator.manual_seed(seed)
    got = _steps(planned, 4)
    for step_expected, step_got in zip(expected, got, strict=True):
        for a, b in zip(step_expected, step_got, strict=True):
            assert torch.equal(a, b)
