"""`ckptrun bench`'s options, checked once: what the plain bench (`driver`) and the goodput
bench under failures (`failure_driver`) both read, below both of them."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError
from ..memory_budget import node_budget
from ..tuning.durations import parse_duration
from . import budget, plan
from .failure_runner import MODES
from .waste import DEFAULT_MTBF_S

FAILURES_MTBF = "30s"  # --mtbf under --failures unless given


@dataclass
class BenchOptions:
    model: str = "small"
    strategies: str = "default"
    every: str = plan.DEFAULTS
    steps: int = 30
    repeat: int = 1
    device: str = "cpu"
    trainer_threads: int = 1
    warmup: int = 2
    dir: str = ""
    json: str = ""
    plot: str = ""
    io_engine: str = "auto"  # the strategies' file writer(s), comma-separated (plan.configurations)
    # Goodput under failures (failure_driver): "" (off), "worker" or "node"
    failures: str = ""
    mtbf: str = ""  # comma-separated durations; "": FAILURES_MTBF under --failures, else waste.DEFAULT_MTBF_S
    duration: str = "2m"  # wall-clock budget of each run
    seed: int = 0
    failure_log: str = ""  # replay this failure trace instead of drawing kills
    traces: str = ""  # write each kill schedule here as a failure trace
    wide: bool = False  # every column of the tables, however narrow the terminal
    durable: str = ""  # a --durable URL: each strategy also runs draining to it (plan.configurations)
    nodes: int = 1  # 2: every run on two namespace nodes (bench/nodes.py)
    replicas: int = 1  # K > 1 (with nodes 2): each strategy also runs as NAME+replicas (plan.configurations)
    max_overhead: str = ""  # given: passed to every ckptrun run; the references' budget (bench/budget.py)
    host_memory: str = ""  # given: passed to every ckptrun run as --host-memory

    def validate(self) -> None:
        if self.model not in plan.MODELS:
            raise UsageError(f"--model must be one of {', '.join(plan.MODELS)} (got {self.model!r})")
        if self.host_memory:
            node_budget(self.host_memory)  # (UsageError naming --host-memory)
        if self.device not in ("cpu", "cuda"):
            raise UsageError(f"--device must be cpu or cuda (got {self.device!r})")
        if self.repeat < 1 or self.trainer_threads < 1 or self.warmup < 0:
            raise UsageError("--repeat and --trainer-threads must be at least 1, --warmup at least 0")
        if self.steps <= self.warmup:
            raise UsageError(f"--steps ({self.steps}) must exceed --warmup ({self.warmup}): "
                             "the figures come from the steps after the warm-up")
        plan.parse_every(self.every)
        self.budget()
        self.mtbf_s()
        if self.failures not in ("", *MODES):
            raise UsageError(f"--failures must be {' or '.join(MODES)} (got {self.failures!r})")
        if self.failures:
            self.duration_s()
        elif self.failure_log or self.traces:
            raise UsageError("--failure-log and --traces belong to the goodput mode: add --failures worker|node")
        if self.nodes not in (1, 2):
            raise UsageError(f"--nodes takes 1 or 2 (got {self.nodes})")
        if self.replicas < 1 or self.replicas > self.nodes:
            raise UsageError(f"--replicas K needs 1 <= K <= --nodes: the copies go to other nodes (got --replicas "
                             f"{self.replicas} with --nodes {self.nodes})")
        if self.nodes > 1:
            if self.failures:
                raise UsageError("--failures runs on one node: leave out --nodes 2")
            from .netns import why_not

            if why := why_not():
                raise UsageError(f"--nodes 2 makes network namespaces, and {why}: run it as root, or use --nodes 1")
        if self.durable:  # unusable: one line now, not a failure per run
            from ..storage.tiers import open_tier

            open_tier(self.durable).probe()

    def first_checkpoint_timed(self) -> list[int]:
        """The --every intervals N whose first checkpoint (step N) falls in the timed steps: its
        one-time costs (the staging slots' allocation and first touch, page-locking on a GPU)
        then count in the figures, once in a short run."""
        return [n for n in plan.parse_every(self.every) if n is not None and self.warmup < n <= self.steps]

    def duration_s(self) -> float:
        return _durations("--duration", self.duration)[0]

    def mtbf_s(self) -> list[float]:
        """Under --failures the MTBFs the kills are drawn at, else those of the predicted waste."""
        if not self.mtbf:
            return _durations("--mtbf", FAILURES_MTBF) if self.failures else [DEFAULT_MTBF_S]
        return _durations("--mtbf", self.mtbf)

    def budget(self) -> float | None:
        """The overhead budget the references keep (None: `--max-overhead off`)."""
        return budget.parse_budget(self.max_overhead)

    def command(self) -> str:
        """The invocation that reproduces this bench (paths as given)."""
        argv = ["ckptrun", "bench", "--model", self.model, "--strategies", self.strategies, "--every", self.every,
                "--steps", str(self.steps), "--repeat", str(self.repeat), "--device", self.device,
                "--trainer-threads", str(self.trainer_threads), "--warmup", str(self.warmup),
                "--io-engine", self.io_engine]
        if self.failures:
            argv += ["--failures", self.failures, "--duration", self.duration, "--seed", str(self.seed)]
            argv += ["--failure-log", self.failure_log] if self.failure_log else ["--mtbf", self.mtbf or FAILURES_MTBF]
        elif self.mtbf:
            argv += ["--mtbf", self.mtbf]
        argv += ["--nodes", str(self.nodes)] if self.nodes > 1 else []
        argv += ["--replicas", str(self.replicas)] if self.replicas > 1 else []
        for flag, value in (("--max-overhead", self.max_overhead), ("--host-memory", self.host_memory),
                            ("--durable", self.durable), ("--dir", self.dir),
                            ("--json", self.json), ("--plot", self.plot), ("--traces", self.traces)):
            argv += [flag, value] if value else []
        return " ".join(argv)

    def run_timeout_s(self) -> float:
        return 300.0 + 20.0 * self.steps


def _durations(flag: str, text: str) -> list[float]:
    try:
        values = [parse_duration(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None
    if not values:
        raise UsageError(f"{flag} needs a duration, e.g. 30s (got {text!r})")
    return values
