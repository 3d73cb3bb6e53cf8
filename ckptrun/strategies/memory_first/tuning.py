"""The memory tier in `ckptrun tune`: every step held in the engine's memory, written to disk
every P steps (`model.py`), instead of one interval; two tiers in the multi-level model.
lowdiff+ plans its replica with it (`REPLICA`); checkfreq, which holds its snapshots so given
`--persist-every`, gets a second row planned with it (`SNAPSHOT`, tuning/plan.py), from the same
measured costs: its snapshot every step is what holding every step costs the trainer."""

from __future__ import annotations

from dataclasses import replace

from ...tuning.levels import Level
from ...tuning.model import Inputs, Prediction, StrategyPlan, TuningModel
from ...tuning.profile import Costs, StrategyCosts
from .model import persist_every, waste


class MemoryFirstTuning(TuningModel):
    """`auto`: the run's option that takes P from the same rates."""

    def __init__(self, auto: str) -> None:
        self.auto = auto

    def settle(self, sp: StrategyPlan, sc: StrategyCosts, inputs: Inputs, answer: None) -> StrategyPlan:
        costs, mtbf_s = inputs.costs, inputs.mtbf_s
        share = inputs.layout.memory_lost_share(inputs.rates)
        every, why = persist_every(sc.persist_s, costs.step_s, mtbf_s, share)
        lost, wasted = waste(sc.delta_s, sc.persist_s, costs.step_s, every, mtbf_s, costs.load_s, share)
        return replace(sp, settings={"persist_every": every},
                       rule=f"in memory every step; persisted every {every} steps: {why} (the failure rates' "
                            f"share; the run's {self.auto} takes it from the same flags)",
                       prediction=Prediction(every * costs.step_s, sc.delta_s / costs.step_s, lost, wasted))

    def levels(self, sp: StrategyPlan, sc: StrategyCosts, costs: Costs) -> list[Level]:
        """Every step in the engine's memory (a process failure resumes from it; a node failure
        too with --replicas > 1), written to --dir every P steps beside training."""
        every = sp.settings["persist_every"]
        return [Level("memory", "every step", sc.delta_s, 0.0, every=1),
                Level("disk", f"--persist-every {every}", sc.persist_s, sc.persist_s, costs.load_s, every=every)]


REPLICA = MemoryFirstTuning("--hw-failure-share auto")
SNAPSHOT = MemoryFirstTuning("--persist-every auto")
