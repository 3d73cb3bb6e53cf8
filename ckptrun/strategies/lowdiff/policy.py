"""LowDiff's save decision: a full checkpoint every F steps, B diffs per written record; an
`auto` F or B follows eq. (10) (`model.py`) from the re-tuner's measurements and is re-tuned as
they move (§VII-A)."""

from __future__ import annotations

from ...errors import UsageError
from ...storage.schema import MAX_DIFF_SPAN
from ..save_policy import Decision, Measured, SavePolicy
from .model import LowDiffCosts, optimal_fb_given, retune

DEFAULT_F, DEFAULT_B = 50, 4
# R_D, the per-record part of replay (manifest, index, checks, opening the data): 4-6 ms per
# diff record of the bench's small model on a 2-core CPU. It only sets B (F hardly moves with it).
RECORD_OPEN_S = 0.005


class FullEveryBatch(SavePolicy):
    def __init__(self, full_every: str | int = "auto", batch: str | int = "auto") -> None:
        self.auto_f, self.auto_b = full_every == "auto", batch == "auto"
        self.full_every = DEFAULT_F if self.auto_f else int(full_every)
        self.batch = DEFAULT_B if self.auto_b else int(batch)
        if self.full_every < 1 or self.batch < 1:
            raise UsageError("--full-every and --batch must be at least 1 (or auto)")
        if self.batch > MAX_DIFF_SPAN:  # a reader refuses longer diff records (schema)
            raise UsageError(f"--batch must be at most {MAX_DIFF_SPAN}")
        self.adjustable = self.auto_f or self.auto_b
        self._tuned = False

    @property
    def settings(self) -> dict[str, int]:
        return {"full_every": self.full_every, "batch": self.batch}

    def due(self, step: int) -> bool:
        """Is a full checkpoint due after `step`?"""
        return step % self.full_every == 0

    def costs(self, m: Measured) -> LowDiffCosts | None:
        """Eq. (8)'s inputs, once a full checkpoint and a diff were sized and a write timed. One
        step's replay is what this worker measured replaying at its resume, else an estimate:
        its diff read at the write bandwidth (no read was timed) plus one optimizer update."""
        full, diff = m.sizes.get("full"), m.sizes.get("diff")
        if not (m.iter_s and full and diff and m.write_bw and m.optim_s):
            return None
        step_replay = m.replay_step_s or diff / m.write_bw + m.optim_s
        return LowDiffCosts(step_time=m.iter_s, full_ckpt_bytes=full, diff_bytes=diff, write_bandwidth=m.write_bw,
                            full_load_time=full / m.write_bw, diff_replay_time=RECORD_OPEN_S, mtbf=m.mtbf_s,
                            step_replay_time=step_replay)

    def propose(self, measured: Measured, step: int) -> Decision | None:
        costs = self.costs(measured)
        if costs is None:
            return None
        fixed = {"fixed_f": None if self.auto_f else self.full_every, "fixed_b": None if self.auto_b else self.batch}
        if not self._tuned:  # the first estimate: the optimum itself; later ones move only if it pays
            self._tuned = True
            f, b = optimal_fb_given(costs, f=fixed["fixed_f"], b=fixed["fixed_b"])
            if (f, min(b, MAX_DIFF_SPAN)) == (self.full_every, self.batch):
                return None
            reason = (f"LowDiff auto: full checkpoint every {f} steps, batch {b} diffs from measured costs "
                      f"(eq. 8 with exact replay: S={costs.full_ckpt_bytes / 1e6:.1f} MB, "
                      f"W={costs.write_bandwidth / 1e6:.0f} MB/s, "
                      f"replay {costs.step_replay_time * 1e3:.1f} ms/step + {costs.diff_replay_time * 1e3:.1f} "
                      f"ms/record, MTBF={costs.mtbf:.0f} s)")
        else:
            (f, b), reason = retune((self.full_every, self.batch), costs, **fixed)
            if reason is None:
                return None
        return Decision({"full_every": f, "batch": min(b, MAX_DIFF_SPAN)}, reason)

    def adopt(self, decision: Decision) -> None:
        self._tuned = True  # (a rank other than 0 adopts rank 0's first decision)
        self.full_every, self.batch = decision.settings["full_every"], decision.settings["batch"]
