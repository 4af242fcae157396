"""Tiny optimizations used by the tests (loaded with OVERLAPKIT_PLUGINS=toy_plugins).

They exercise the contract without doing real overlap work: `toy_probe`
records every event it sees and writes what it saw, per rank, to the run
folder; `toy_fail` raises on one rank at one step.
"""

from __future__ import annotations

import json
import os
import signal
import time

import torch

from overlapkit.runtime import Event, Knob, Optimization, Resource, register_optimization


@register_optimization
class ToyProbe(Optimization):
    """Records the events it sees and the model's parameter checksum."""

    name = "toy_probe"
    knobs = (
        Knob(name="depth", type=int, default=1, low=1, high=16, intensity=(1, 16), log=True),
        Knob(
            name="mode", type=str, default="a", choices=("a", "b", "c"), intensity=("a", "b", "c")
        ),
        Knob(name="ratio", type=float, default=0.5, low=0.0, high=1.0),
    )
    resources = frozenset({Resource.HOST_CPU})

    def __init__(self, intensity: float = 1.0, **explicit):
        super().__init__(intensity, **explicit)
        self.events: list[tuple[int, str]] = []
        self.steps_seen = 0

    def _record(self, event: Event, state) -> None:
        self.events.append((state.step, event.value))
        if event is Event.STEP_END:
            self.steps_seen += 1

    def on_fit_start(self, state):
        self._record(Event.FIT_START, state)
        if state.run_dir is not None:
            (state.run_dir / f"pid-rank{state.world.rank}.txt").write_text(str(os.getpid()))

    def on_fit_end(self, state):
        self._record(Event.FIT_END, state)
        if state.run_dir is not None:
            model = state.model.module if hasattr(state.model, "module") else state.model
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            probe = {
                "rank": state.world.rank,
                "events": self.events,
                "param_sum": float(flat.double().sum()),
                "param_abs_sum": float(flat.double().abs().sum()),
                "steps_seen": self.steps_seen,
                "threads": torch.get_num_threads(),
            }
            path = state.run_dir / f"probe-rank{state.world.rank}.json"
            path.write_text(json.dumps(probe))

    def state_dict(self):
        return {"steps_seen": self.steps_seen}

    def load_state_dict(self, state):
        self.steps_seen = state["steps_seen"]


def _recorder(event: Event):
    return lambda self, state: self._record(event, state)


for _event in Event:
    if _event not in (Event.FIT_START, Event.FIT_END):
        setattr(ToyProbe, _event.hook_name, _recorder(_event))


@register_optimization
class ToyFail(Optimization):
    """Fails on rank ``rank`` when step ``step`` starts: raises, dies by SIGKILL, or
    plays a user's interrupt (not in a run that resumed from a checkpoint):
    ``sigint`` is Ctrl-C in a terminal (SIGINT to the whole process group),
    ``sigterm`` a `kill` of the command (SIGTERM to the group's leader)."""

    name = "toy_fail"
    knobs = (
        Knob(name="rank", type=int, default=1, low=0, high=1024),
        Knob(name="step", type=int, default=2, low=0, high=10**6),
        Knob(
            name="how", type=str, default="raise", choices=("raise", "sigkill", "sigint", "sigterm")
        ),
        Knob(name="at", type=str, default="step_start", choices=("step_start", "step_end")),
    )

    def on_step_start(self, state):
        if self.settings["at"] == "step_start":
            self._fail(state)

    def on_step_end(self, state):
        if self.settings["at"] == "step_end":
            self._fail(state)

    def _fail(self, state):
        if state.world.rank != self.settings["rank"] or state.step != self.settings["step"]:
            return
        how = self.settings["how"]
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how in ("sigint", "sigterm"):
            if state.resumed_from is None:
                if how == "sigint":
                    os.killpg(os.getpgid(0), signal.SIGINT)
                else:
                    os.kill(os.getpgid(0), signal.SIGTERM)
            return
        raise RuntimeError(
            f"toy failure on rank {state.world.rank} at step {state.step} (pid {os.getpid()})"
        )


@register_optimization
class ToySleep(Optimization):
    """Sleeps ``ms`` at the start of each step: a cost of known size that grows with
    the intensity (so a tuner must learn to turn it off)."""

    name = "toy_sleep"
    knobs = (
        # From 50 ms, 5x a tiny step: a tuner must see its cost on a loaded machine too.
        Knob(name="ms", type=float, default=0.0, low=0.0, high=1000.0, intensity=(50.0, 200.0)),
    )

    def on_step_start(self, state):
        time.sleep(self.settings["ms"] / 1000)


@register_optimization
class ToyGate(Optimization):
    """Holds runs at step ``step`` on rank 0: the first run to get there passes, later
    ones wait until the file ``{path}.open`` exists. A test can so keep a tune trial
    running for as long as it needs, without racing the clock."""

    name = "toy_gate"
    knobs = (
        Knob(name="path", type=str, default=""),
        Knob(name="step", type=int, default=2, low=0, high=10**6),
    )

    def on_step_start(self, state):
        if state.world.rank != 0 or state.step != self.settings["step"]:
            return
        path = self.settings["path"]
        try:
            os.close(os.open(f"{path}.first", os.O_CREAT | os.O_EXCL))
            return  # the first run
        except FileExistsError:
            pass
        while not os.path.exists(f"{path}.open"):
            time.sleep(0.05)
