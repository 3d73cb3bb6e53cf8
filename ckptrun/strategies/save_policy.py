"""The save-policy vocabulary a strategy writes its own save decision in (DESIGN §6).

In the manner of Orbax's `SaveDecisionPolicy`, a policy holds its settings and answers `due`;
unlike a fixed rule it may also `propose` new settings from what was measured. A strategy hands
its policies to the worker through `StrategyContext.policy` / `use_interval`; the worker's
re-tuner (ckptrun/worker/decisions.py) feeds them every measurement, asks them at its evaluation
steps and makes the ranks agree. Defined here, beside the strategies, so that a strategy never
imports the worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..tuning.durations import format_duration

MIN_CHANGE = 0.2  # relative change of an interval below which it is kept


@dataclass(frozen=True)
class Measured:
    """What the re-tuner measured, the same for every policy; None where nothing was measured yet."""

    mtbf_s: float
    mtbf_given: bool
    step_s: float | None = None  # compute time of one step, checkpoint stall excluded
    iter_s: float | None = None  # wall time of one step, stall included
    optim_s: float | None = None  # one optimizer step (what replaying one step's gradients costs)
    replay_step_s: float | None = None  # replay of one recorded step at this worker's resume, read included
    delta_s: float | None = None  # blocking cost of one checkpoint; None while none was handed over
    persist_s: float | None = None  # time to persist one checkpoint's bytes
    write_bw: float | None = None  # bytes per second of recent writes
    sizes: dict[str, int] = field(default_factory=dict)  # bytes of the last snapshot of each kind
    # --max-overhead (ckptrun/worker/budget.py): the budget (a fraction; None: off), the step without
    # checkpointing, what one checkpoint costs the loop (stall but back-pressure, plus the step's
    # slowdown) and the window's overhead (a fraction of the no-checkpoint step)
    budget: float | None = None
    base_step_s: float | None = None
    cost_s: float | None = None
    overhead: float | None = None

    @property
    def mtbf_text(self) -> str:
        return format_duration(self.mtbf_s) + ("" if self.mtbf_given else " (default; set --mtbf)")


@dataclass(frozen=True)
class Decision:
    settings: dict[str, int]
    reason: str

    def to_json(self) -> dict:
        return {"settings": self.settings, "reason": self.reason}

    @classmethod
    def from_json(cls, body: dict) -> Decision:
        return cls({k: int(v) for k, v in body["settings"].items()}, str(body["reason"]))


class SavePolicy:
    """One save decision. `label` prefixes its log lines; a policy that never changes keeps the
    default `propose`."""

    label = ""
    adjustable = True  # False: `propose` never changes anything (the re-tuner skips it)

    @property
    def settings(self) -> dict[str, int]:
        raise NotImplementedError

    def due(self, step: int) -> bool:
        raise NotImplementedError

    def propose(self, measured: Measured, step: int) -> Decision | None:
        """New settings if the measurements call for them (with the reason), else None."""
        return None

    def adopt(self, decision: Decision) -> None:
        """Take the settings all ranks agreed on."""
        raise NotImplementedError


class IntervalPolicy(SavePolicy):
    """Checkpoint every `every` steps. Subclasses say what the interval should be (`target`);
    a change smaller than MIN_CHANGE is ignored unless the current interval breaks a floor."""

    label = "--every auto"

    def __init__(self, every: int = 1) -> None:
        self.every = every

    @property
    def settings(self) -> dict[str, int]:
        return {"every": self.every}

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def target(self, m: Measured) -> tuple[int, str, int] | None:
        """(steps, why, floor): the interval wanted, its reason, and a hard lower bound."""
        return None

    def propose(self, measured: Measured, step: int) -> Decision | None:
        wanted = self.target(measured)
        if wanted is None:
            return None
        steps, why, floor = wanted
        if steps == self.every or (self.every >= floor and abs(steps - self.every) < MIN_CHANGE * self.every):
            return None
        return Decision({"every": steps}, f"every {self.every} -> {steps} steps at step {step}: {why}")

    def adopt(self, decision: Decision) -> None:
        self.every = decision.settings["every"]
