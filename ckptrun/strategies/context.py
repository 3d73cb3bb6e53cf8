"""`StrategyContext`: the one surface a strategy's trainer side may use, and `Snapshot`, what
a strategy sees of a snapshot on its way to the engine.

Both are defined here, beside the strategies, and implemented by the worker
(ckptrun/worker/context.py, ckptrun/worker/capture.py): a strategy never imports the worker,
the engine client or the metrics writer, so the worker can change behind this surface and a new
strategy is written against a dozen documented calls.

Call order for one checkpoint (see `SnapshotStrategy` for the simplest user):

1. `capture(step, background=...)` right after optimizer step `step` (parameters, optimizer
   state, buffers, RNG into a free staging slot; back-pressure when none is free), or
   `begin(step, kind)` for a snapshot of the strategy's own state;
2. `add(snap, state)` any number of times (more tensors and JSON-able values);
3. `wait_copy(snap)` before the trainer changes what a background copy still reads;
4. `seal(snap)`, at the next step's start or at the end: adds what settles after the step
   (schedulers, scaler, tracked objects) and waits for the copies;
5. `submit(snap[, message, **fields])`: the engine persists it as the full checkpoint of its
   step, or the strategy's engine-side handler receives the strategy's own `message`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from ..ipc.messages import Persist

if TYPE_CHECKING:
    import torch

    from ..ipc.messages import Message
    from ..memory_budget import Budget
    from ..storage.layout import Layout, TensorSpec
    from .save_policy import IntervalPolicy, SavePolicy


class Snapshot(Protocol):
    """A snapshot as a strategy reads it: made by `begin`/`capture`, filled by `add`/`put`."""

    step: int
    slot: int  # the staging slot it is in (-1: the strategy's own buffer, `capture(into=...)`)
    skeleton: dict  # its JSON-able state, tensors replaced by their keys
    layout: Layout  # where each tensor lies in the slot
    nbytes: int
    buf: torch.Tensor | None  # the strategy's own buffer it is copied into, if not a staging slot
    copy: Future | None  # its background copy on the CPU, while one runs


class Resumed(Protocol):
    """The committed step a worker resumed from."""

    step: int
    record: str  # the record its base state was read from ("memory": the engine's copy)
    state: dict  # keyed like the checkpoint: models, optimizers, schedulers, scalers, extra, rng
    world_size: int  # of the run that wrote it
    source: str  # "disk" or "memory"
    diffs: Iterator[dict] | None  # recorded steps replayed after its base (None: resumed at a full one)


class StrategyContext(ABC):
    """Implemented by the worker; the methods without a docstring do what their name says."""

    # ---- the run ------------------------------------------------------------------------
    @property
    @abstractmethod
    def step(self) -> int:
        """Completed optimizer steps of the primary optimizer."""

    @property
    @abstractmethod
    def rank(self) -> int:
        ...

    @property
    @abstractmethod
    def world_size(self) -> int:
        ...

    @property
    @abstractmethod
    def options(self) -> dict[str, Any]:
        """This strategy's option values as given (strings or None; ckptrun/strategies/options.py),
        plus `mtbf` in seconds when --mtbf was given, `max_overhead` (--max-overhead, a fraction;
        0: off) and `memory_lost_share`, the share of
        failures that no engine's memory survives (`Layout.memory_lost_share`, tuning/levels.py)."""

    @property
    @abstractmethod
    def dir(self) -> str:
        """The checkpoint directory (--dir)."""

    @property
    @abstractmethod
    def every(self) -> int:
        ...

    @property
    @abstractmethod
    def max_inflight(self) -> int:
        ...

    @property
    @abstractmethod
    def replicas(self) -> int:
        """--replicas K: copies of each step in partners' memory (1: none)."""

    @property
    @abstractmethod
    def host_memory(self) -> Budget:
        """This rank's host-memory budget (--host-memory, ckptrun/memory_budget.py): declare each
        host buffer the strategy keeps (`set`, or `claim` for an explicit setting, refused when it
        does not fit) and choose tunable sizes within `room`."""

    @property
    @abstractmethod
    def staging_slots(self) -> int:
        """Staging slots per generation: --max-inflight, or fewer where the budget decided."""

    @property
    @abstractmethod
    def final_checkpoint(self) -> bool:
        """Whether the step the script ends at is checkpointed even when not due."""

    @property
    @abstractmethod
    def resume(self) -> Resumed | None:
        """The committed step this worker resumed from (None on a fresh start)."""

    @property
    @abstractmethod
    def checkpointed_step(self) -> int | None:
        """The newest step committed already or captured by this run."""

    @property
    @abstractmethod
    def primary(self) -> torch.optim.Optimizer | None:
        ...

    @property
    @abstractmethod
    def models(self) -> dict[str, torch.nn.Module]:
        ...

    @abstractmethod
    def due(self, step: int) -> bool:
        """Is a checkpoint of `step` due (interval, --every auto, a stop after this step)?"""

    @property
    @abstractmethod
    def every_auto(self) -> bool:
        """The interval is the strategy's to choose online: --every auto, or --every left unset
        under --max-overhead (its `use_interval` rule is then kept within the budget)."""

    @property
    @abstractmethod
    def every_given(self) -> bool:
        """--every N was given (not left at its default): every multiple of N must be restorable
        once the run ends (a strategy may commit more steps, never fewer)."""

    @abstractmethod
    def use_interval(self, policy: IntervalPolicy) -> None:
        """Replace the run's `--every auto` rule (Daly's) with the strategy's own."""

    @abstractmethod
    def policy(self, policy: SavePolicy) -> SavePolicy:
        """Register the strategy's own save decision (ckptrun/strategies/save_policy.py) with the
        worker's re-tuner: it is fed the same measurements, re-decided at the same steps and
        agreed across ranks; changes are logged and recorded. Call from `__init__`."""

    # ---- snapshots ----------------------------------------------------------------------
    @abstractmethod
    def capture(self, step: int, *, background: bool,
                stream: Callable[[Snapshot], Callable[[int], None]] | None = None,
                into: Callable[[int], torch.Tensor | None] | None = None,
                order: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
                lazy: bool = False, whole: bool = False) -> Snapshot:
        """`stream(snap)`, called once the slot is taken, returns a callback told each time the
        slot's first N bytes are final (for a handler persisting chunks while the copy runs);
        such a slot is freed only by the engine. `order(tensors)` returns them in the order to
        lay out and copy (e.g. the order the next update needs them); `into(nbytes)` returns the
        buffer to copy into instead of a staging slot (a mapped region slot), or None. A
        snapshot that outgrows that buffer moves to a staging slot (`snap.buf` is None then).
        `lazy` (background, no `into`): only buffers and RNG are taken now; the rest of the state
        is gathered and copied on the copier thread (the slot is taken there: `stream` is called
        from it, with the skeleton known); `wait_copy` before the next update.

        Under DDP, with the strategy's `Entry.write_once`, each replicated tensor (parameters,
        optimizer state over them) is captured by the one rank that writes it
        (storage/writeonce.py); `whole` captures every tensor on every rank (for an engine that
        keeps the state and leaves them out when it writes it: `replicated_positions`)."""

    @property
    @abstractmethod
    def staging_bytes(self) -> int:
        """Bytes of one staging slot (a snapshot never exceeds the slot it is in)."""

    @abstractmethod
    def index_hint(self) -> int:
        """About how many bytes the JSON index of a full checkpoint of this run takes."""

    @abstractmethod
    def begin(self, step: int, kind: str = "full", need: int = 0, prefix: str = "") -> Snapshot:
        ...

    @abstractmethod
    def add(self, snap: Snapshot, state: dict, *, background: bool = False, write_once: bool = False) -> None:
        """`write_once`: under DDP (with `Entry.write_once`), the replicated tensors in `state`
        (parameters, their all-reduced gradients at the step, optimizer state over them) are each
        added by the one rank that writes them; which rank turns with the step."""

    @abstractmethod
    def replicated_positions(self) -> list[int]:
        """Positions of the primary optimizer's parameters that DDP keeps identical on every rank
        when replicated state is written once (else empty): an engine-side handler that writes a
        state it built itself leaves their tensors to one rank (`writeonce.split_state`)."""

    @abstractmethod
    def shared_positions(self) -> list[int]:
        """The same positions where every rank writes their tensors and the index names them
        (--node-local-dir --replicas: a partner's copy leaves them out, `writeonce.shared_keys`)."""

    @abstractmethod
    def reserve(self, snap: Snapshot, skeleton: dict, like: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
        """Places in `snap` for tensors shaped like `like` (named by `skeleton`), filled later by
        `put`: for state that becomes final piece by piece (layer-wise gradients in backward)."""

    @abstractmethod
    def put(self, snap: Snapshot, places: list[tuple[TensorSpec, torch.Tensor]]) -> None:
        """Copy each tensor into its reserved place in the background (the last put of a place
        wins; `wait_copy` waits for all of them)."""

    @abstractmethod
    def post_step_state(self) -> dict:
        """Module buffers and RNG right after the step: what replaying its gradients cannot rebuild."""

    @abstractmethod
    def wait_copy(self, snap: Snapshot) -> None:
        ...

    @abstractmethod
    def discard(self, snap: Snapshot) -> None:
        """Give up a snapshot begun but not to be submitted (its slot is free again)."""

    @abstractmethod
    def seal(self, snap: Snapshot, *, wait: bool = True) -> None:
        """`wait=False`: do not wait for the copies still running (the `stream` callback reports
        their end, `snap.nbytes` once this returns)."""

    @abstractmethod
    def submit(self, snap: Snapshot, message: type[Persist] = Persist, *, wait_durable: bool = False,
               layout: str = "records", **fields: Any) -> None:
        """`layout="file"`: the handler writes one self-describing file per rank, the skeleton
        reaching it as objects the strategy sends itself (the spec carries none)."""

    # ---- engine and metrics -------------------------------------------------------------
    @abstractmethod
    def request(self, msg: Message) -> dict:
        """Ask this strategy's engine-side handler something; returns the reply's body."""

    @abstractmethod
    def send(self, msg: Message) -> None:
        """Tell this strategy's engine-side handler something (no reply); any thread."""

    @abstractmethod
    def stall(self, cause: str, seconds: float) -> None:
        """Count `seconds` the trainer was blocked in a hook as stall of `cause` (ipc/events.py)."""

    @abstractmethod
    def update_ran(self, seconds: float) -> None:
        """A hook spent `seconds` running the optimizer's own update (split in parts): not
        stall, and counted as the update's time."""

    @abstractmethod
    def emit(self, **event: Any) -> None:
        """Append an event to this rank's metrics (dashboard, --metrics-file)."""
