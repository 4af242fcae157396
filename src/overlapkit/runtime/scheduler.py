"""Composes optimizations onto one loop: validate, order, wrap, dispatch, trace.

The order of wrapping is fixed and lives here only: the model is split into
pipeline stages first (`WrapStage.SPLIT`), then wrapped for data parallelism
(`WrapStage.DATA_PARALLEL`), then by everything else (`WrapStage.OTHER`);
within a stage, in hook order. Optimizer and loader wrappers follow hook order.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any, Literal

from pydantic import model_validator

from ..config import Config
from .arbitration import ArbitrationPolicy
from .events import Event
from .optimization import (
    CombinationError,
    KnobError,
    Optimization,
    Plan,
    WrapStage,
    check_framework,
)
from .policies import POLICIES
from .state import State


class SchedulerConfig(Config):
    policy: Literal["free", "priority", "partition"] = "free"
    trace: bool = False  # also write a Chrome/Perfetto trace of the hooks
    # The partition policy's own knobs (`PartitionPolicy.knobs`); used when it is chosen.
    partition: dict[str, Any] = {}

    @model_validator(mode="after")
    def _check_settings(self) -> SchedulerConfig:
        try:
            POLICIES["partition"].resolve(self.partition)
        except KnobError as error:
            raise ValueError(f"scheduler.partition: {error}") from None
        return self

    def build(self) -> ArbitrationPolicy:
        """The policy, with its settings."""
        cls = POLICIES[self.policy]
        return cls(**self.partition) if cls.name == "partition" else cls()


class Trace:
    """What ran at each event, in which order and for how long.

    Every call is aggregated; the first ``max_entries`` are also kept one by one.
    """

    def __init__(self, max_entries: int = 100_000) -> None:
        self.entries: list[tuple[int, str, str, float, float]] = []
        self.max_entries = max_entries
        self.totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
        self.marks: list[tuple[int, str, float, dict[str, Any]]] = []  # instants, with details
        self._origin = perf_counter()

    def mark(self, step: int, name: str, args: dict[str, Any]) -> None:
        """An instant worth seeing in the trace (the policy's split of the cores)."""
        self.marks.append((step, name, perf_counter() - self._origin, args))

    def record(self, step: int, event: Event, name: str, start: float, end: float) -> None:
        if len(self.entries) < self.max_entries:
            self.entries.append((step, event.value, name, start - self._origin, end - start))
        total = self.totals[(name, event.value)]
        total[0] += 1
        total[1] += end - start

    def order_at(self, event: Event, step: int | None = None) -> list[str]:
        """The optimizations that ran at ``event`` (in the first step it fired, or ``step``)."""
        steps = [s for s, e, *_ in self.entries if e == event.value]
        if not steps:
            return []
        wanted = steps[0] if step is None else step
        return [n for s, e, n, *_ in self.entries if e == event.value and s == wanted]

    def summary(self) -> dict[str, dict[str, dict[str, float]]]:
        out: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
        for (name, event), (calls, seconds) in sorted(self.totals.items()):
            out[name][event] = {"calls": calls, "total_s": seconds}
        return dict(out)

    def chrome_events(self, pid: int = 0) -> list[dict[str, Any]]:
        """Entries in the Chrome trace-event format (opens in Perfetto)."""
        hooks = [
            {
                "name": f"{name}.{event}",
                "cat": "hook",
                "ph": "X",
                "ts": start * 1e6,
                "dur": duration * 1e6,
                "pid": pid,
                "tid": 0,
                "args": {"step": step},
            }
            for step, event, name, start, duration in self.entries
        ]
        marks = [
            {
                "name": name,
                "cat": "scheduler",
                "ph": "i",
                "s": "p",
                "ts": at * 1e6,
                "pid": pid,
                "tid": 0,
                "args": {"step": step, **args},
            }
            for step, name, at, args in self.marks
        ]
        return hooks + marks


def resolve_order(optimizations: Sequence[Optimization]) -> list[Optimization]:
    """Check conflicts and roles, then order by the declared ``after``/``before``
    (ties keep the given order). Raises `CombinationError`."""
    by_name: dict[str, Optimization] = {}
    for opt in optimizations:
        if opt.name in by_name:
            raise CombinationError(f"optimization {opt.name!r} is listed twice")
        by_name[opt.name] = opt
    role_owner: dict[str, str] = {}
    for opt in optimizations:
        for other in opt.conflicts:
            if other in by_name:
                raise CombinationError(f"{opt.name} cannot run together with {other}")
        for role in opt.provides:
            if role in role_owner:
                raise CombinationError(
                    f"{role_owner[role]} and {opt.name} both provide {role}; enable only one"
                )
            role_owner[role] = opt.name
    successors: dict[str, set[str]] = {name: set() for name in by_name}
    for opt in optimizations:
        for earlier in opt.after:
            if earlier in by_name:
                successors[earlier].add(opt.name)
        for later in opt.before:
            if later in by_name:
                successors[opt.name].add(later)
    indegree = {name: 0 for name in by_name}
    for targets in successors.values():
        for target in targets:
            indegree[target] += 1
    position = {name: i for i, name in enumerate(by_name)}
    ready = sorted((n for n, d in indegree.items() if d == 0), key=position.__getitem__)
    ordered: list[Optimization] = []
    while ready:
        name = ready.pop(0)
        ordered.append(by_name[name])
        for target in successors[name]:
            indegree[target] -= 1
            if indegree[target] == 0:
                ready.append(target)
        ready.sort(key=position.__getitem__)
    if len(ordered) != len(by_name):
        stuck = sorted(n for n, d in indegree.items() if d > 0)
        raise CombinationError(f"the after/before declarations form a cycle among {stuck}")
    return ordered


class Scheduler:
    """Runs the hooks of a validated, ordered set of optimizations."""

    def __init__(
        self, optimizations: Sequence[Optimization] = (), policy: ArbitrationPolicy | str = "free"
    ) -> None:
        self.optimizations = resolve_order(optimizations)
        self.policy = POLICIES[policy]() if isinstance(policy, str) else policy
        self.trace = Trace()
        self._hooks: dict[Event, list[tuple[str, Callable[[State], None]]]] = {}
        for event in Event:
            hooks = [
                (opt.name, getattr(opt, event.hook_name))
                for opt in self.optimizations
                if callable(getattr(opt, event.hook_name, None))
            ]
            self._hooks[event] = hooks[::-1] if event.is_exit else hooks

    def provides(self, role: str) -> bool:
        return any(role in opt.provides for opt in self.optimizations)

    def check(
        self,
        world_size: int,
        device: str,
        backend: str,
        *,
        batch_size: int | None = None,
        build_model: Callable[[], Any] | None = None,
        precision: str = "fp32",
        accumulate: int = 1,
        framework: str = "torch",
    ) -> None:
        """Each optimization's own checks, then its checks of the whole plan."""
        if framework not in self.policy.frameworks:
            raise CombinationError(
                f"scheduler.policy {self.policy.name} runs on {' and '.join(self.policy.frameworks)}"
                f" only: {self.policy.why_not}"
            )
        for opt in self.optimizations:
            check_framework(opt, framework)
        for opt in self.optimizations:
            opt.check(world_size, device, backend)
        plan = Plan(
            world_size=world_size,
            device=device,
            backend=backend,
            optimizations={opt.name: opt for opt in self.optimizations},
            data_parallel_size=self.data_shard(0, world_size)[1],
            batch_size=batch_size,
            build_model=build_model,
            precision=precision,
            accumulate=accumulate,
            framework=framework,
        )
        for opt in self.optimizations:
            opt.check_plan(plan)

    def data_shard(self, rank: int, world_size: int) -> tuple[int, int]:
        """Which data shard ``rank`` reads, of how many: its own unless the model is split."""
        for opt in self.optimizations:
            shard = opt.data_shard(rank, world_size)
            if shard is not None:
                return shard
        return rank, world_size

    def provider(self, role: str) -> Optimization | None:
        return next((opt for opt in self.optimizations if role in opt.provides), None)

    def wrap(self, state: State) -> None:
        """Apply every wrapper to the state's model, optimizer and loader, in the fixed order."""
        state.local_model = state.model
        for opt in sorted(self.optimizations, key=lambda o: o.wrap_stage):
            state.model = opt.wrap_model(state.model, state)
            if opt.wrap_stage == WrapStage.SPLIT:
                state.local_model = state.model
        for opt in self.optimizations:
            if state.optimizer is not None:
                state.optimizer = opt.wrap_optimizer(state.optimizer, state)
            if state.loader is not None:
                state.loader = opt.wrap_loader(state.loader, state)

    def arrange(self, state: State) -> None:
        """Before the first step: the policy places the work the optimizations declare."""
        demands = [d for opt in self.optimizations for d in opt.cpu_demands(state)]
        self.policy.arrange(state, demands, self.trace.mark)

    def fire(self, event: Event, state: State) -> None:
        hooks = self._hooks[event]
        if not hooks:
            return
        # Hook time counts as "other" unless the hook claims a phase itself.
        previous = state.clock.switch("other")
        for name, hook in hooks:
            start = perf_counter()
            hook(state)
            self.trace.record(state.step, event, name, start, perf_counter())
        state.clock.switch(previous)

    def state_dict(self) -> dict[str, Any]:
        return {opt.name: opt.state_dict() for opt in self.optimizations}

    def load_state_dict(self, states: dict[str, Any]) -> None:
        for opt in self.optimizations:
            if opt.name in states:
                opt.load_state_dict(states[opt.name])

    def summary(self) -> dict[str, Any]:
        return {opt.name: opt.summary() for opt in self.optimizations}
