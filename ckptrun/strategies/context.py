"""`StrategyContext`: the one surface a strategy's trainer side may use.

The worker's Runtime implements it; a strategy never touches the Runtime, the engine client or
the metrics writer directly, so the runtime can change behind this surface and a new strategy
is written against a dozen documented calls.

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

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..ipc.messages import Persist

if TYPE_CHECKING:
    import torch

    from ..ipc.messages import Message
    from ..memory_budget import Budget
    from ..storage.layout import TensorSpec
    from ..worker.decisions import IntervalPolicy, SavePolicy
    from ..worker.runtime import ResumeState, Runtime, Snapshot


class StrategyContext:
    def __init__(self, rt: Runtime) -> None:
        self._rt = rt

    # ---- the run ------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Completed optimizer steps of the primary optimizer."""
        return self._rt.step

    @property
    def rank(self) -> int:
        return self._rt.rank

    @property
    def world_size(self) -> int:
        return self._rt.world_size

    @property
    def options(self) -> dict[str, Any]:
        """This strategy's option values as given (strings or None; ckptrun/strategies/options.py),
        plus `mtbf` in seconds when --mtbf was given."""
        return self._rt.cfg.options

    @property
    def dir(self) -> str:
        """The checkpoint directory (--dir)."""
        return self._rt.cfg.dir

    @property
    def every(self) -> int:
        return self._rt.cfg.every

    @property
    def max_inflight(self) -> int:
        return self._rt.cfg.max_inflight

    @property
    def host_memory(self) -> Budget:
        """This rank's host-memory budget (--host-memory, ckptrun/memory_budget.py): declare each
        host buffer the strategy keeps (`set`, or `claim` for an explicit setting, refused when it
        does not fit) and choose tunable sizes within `room`."""
        return self._rt.budget

    @property
    def staging_slots(self) -> int:
        """Staging slots per generation: --max-inflight, or fewer where the budget decided."""
        return self._rt._nslots

    @property
    def final_checkpoint(self) -> bool:
        """Whether the step the script ends at is checkpointed even when not due."""
        return self._rt.cfg.final_checkpoint

    @property
    def resume(self) -> ResumeState | None:
        """The committed step this worker resumed from (None on a fresh start)."""
        return self._rt.resume

    @property
    def checkpointed_step(self) -> int | None:
        """The newest step committed already or captured by this run."""
        return self._rt.checkpointed_step

    @property
    def primary(self) -> torch.optim.Optimizer | None:
        return self._rt.primary

    @property
    def models(self) -> dict[str, torch.nn.Module]:
        return self._rt.models

    def due(self, step: int) -> bool:
        """Is a checkpoint of `step` due (interval, --every auto, a stop after this step)?"""
        return self._rt.due(step)

    @property
    def every_auto(self) -> bool:
        return self._rt.cfg.every_auto

    @property
    def every_given(self) -> bool:
        """--every N was given (not left at its default): every multiple of N must be restorable
        once the run ends (a strategy may commit more steps, never fewer)."""
        return self._rt.cfg.every_given

    def use_interval(self, policy: IntervalPolicy) -> None:
        """Replace the run's `--every auto` rule (Daly's) with the strategy's own."""
        self._rt.use_interval(policy)

    def policy(self, policy: SavePolicy) -> SavePolicy:
        """Register the strategy's own save decision (ckptrun/worker/decisions.py) with the
        worker's re-tuner: it is fed the same measurements, re-decided at the same steps and
        agreed across ranks; changes are logged and recorded. Call from `__init__`."""
        return self._rt.retuner.add(policy)

    # ---- snapshots ----------------------------------------------------------------------
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
        return self._rt.capture(step, background=background, stream=stream, into=into, order=order, lazy=lazy,
                                whole=whole)

    @property
    def staging_bytes(self) -> int:
        """Bytes of one staging slot (a snapshot never exceeds the slot it is in)."""
        return self._rt.slots.nbytes

    def index_hint(self) -> int:
        """About how many bytes the JSON index of a full checkpoint of this run takes."""
        return self._rt.index_hint()

    def begin(self, step: int, kind: str = "full", need: int = 0, prefix: str = "") -> Snapshot:
        return self._rt.begin(step, kind, need, prefix)

    def add(self, snap: Snapshot, state: dict, *, background: bool = False, write_once: bool = False) -> None:
        """`write_once`: under DDP (with `Entry.write_once`), the replicated tensors in `state`
        (parameters, their all-reduced gradients at the step, optimizer state over them) are each
        added by the one rank that writes them; which rank turns with the step."""
        self._rt.add(snap, state, background=background, write_once=write_once)

    def replicated_positions(self) -> list[int]:
        """Positions of the primary optimizer's parameters that DDP keeps identical on every rank
        when replicated state is written once (else empty): an engine-side handler that writes a
        state it built itself leaves their tensors to one rank (`writeonce.split_state`)."""
        return self._rt.replicated_positions()

    def reserve(self, snap: Snapshot, skeleton: dict, like: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
        """Places in `snap` for tensors shaped like `like` (named by `skeleton`), filled later by
        `put`: for state that becomes final piece by piece (layer-wise gradients in backward)."""
        return self._rt.reserve(snap, skeleton, like)

    def put(self, snap: Snapshot, places: list[tuple[TensorSpec, torch.Tensor]]) -> None:
        """Copy each tensor into its reserved place in the background (the last put of a place
        wins; `wait_copy` waits for all of them)."""
        self._rt.put(snap, places)

    def post_step_state(self) -> dict:
        """Module buffers and RNG right after the step: what replaying its gradients cannot rebuild."""
        return self._rt.post_step_state()

    def wait_copy(self, snap: Snapshot) -> None:
        self._rt.wait_copy(snap)

    def discard(self, snap: Snapshot) -> None:
        """Give up a snapshot begun but not to be submitted (its slot is free again)."""
        self._rt.discard(snap)

    def seal(self, snap: Snapshot, *, wait: bool = True) -> None:
        """`wait=False`: do not wait for the copies still running (the `stream` callback reports
        their end, `snap.nbytes` once this returns)."""
        self._rt.seal(snap, wait=wait)

    def submit(self, snap: Snapshot, message: type[Persist] = Persist, *, wait_durable: bool = False,
               layout: str = "records", **fields: Any) -> None:
        """`layout="file"`: the handler writes one self-describing file per rank, the skeleton
        reaching it as objects the strategy sends itself (the spec carries none)."""
        self._rt.submit(snap, message, wait_durable=wait_durable, layout=layout, **fields)

    # ---- engine and metrics -------------------------------------------------------------
    def request(self, msg: Message) -> dict:
        """Ask this strategy's engine-side handler something; returns the reply's body."""
        return self._rt.client.request(msg)

    def send(self, msg: Message) -> None:
        """Tell this strategy's engine-side handler something (no reply); any thread."""
        self._rt.client.send(msg)

    def stall(self, cause: str, seconds: float) -> None:
        """Count `seconds` the trainer was blocked in a hook as stall of `cause` (ipc/events.py)."""
        self._rt.metrics.add_stall(cause, seconds)

    def update_ran(self, seconds: float) -> None:
        """A hook spent `seconds` running the optimizer's own update (split in parts): not
        stall, and counted as the update's time."""
        self._rt.update_s += seconds

    def emit(self, **event: Any) -> None:
        """Append an event to this rank's metrics (dashboard, --metrics-file)."""
        self._rt.metrics.emit(**event)
