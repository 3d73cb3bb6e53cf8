"""Which committed step to restore, and the state of one rank at that step.

A step is restorable from a full checkpoint alone, or from a full checkpoint (the base) plus
the committed differential records that follow it without a gap (LowDiff's chain), at per-step
granularity. Restore never trusts a record blindly: every checksum is re-checked, a damaged
record is skipped with a warning and the newest good step before it is used.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from queue import Empty, Queue
from typing import Any

from pydantic import ValidationError

from ..errors import CkptrunError, CorruptCheckpoint, StepNotAvailable, UsageError
from ..log import log
from ..storage.layout import ReadBuffer
from ..storage.schema import DiffStep, SavedOptimizer, StateSkeleton, problem, short
from ..storage.sharding import Sharded, choose
from ..storage.store import Manifest, Store
from ..storage.tree import ORPHANS, REMOTE, TENSOR, orphans_key, shards_of, unflatten
from ..storage.writeonce import remote_refs

READ_AHEAD_BYTES = 256 << 20  # diff records read and checked ahead of replay (memory bound)
# ... and at most this many records: reading faster than replay gains nothing from more, and each
# record ahead is one more read buffer whose pages are faulted in before it can be reused
READ_AHEAD_RECORDS = 2
CPU_ALLOCATOR = "DefaultCPUAllocator"  # in the RuntimeError torch raises where host memory runs out


@dataclass
class Plan:
    """Restore `step`: load `base`, then replay the steps of `diffs` up to `step`."""

    step: int
    base: Manifest
    diffs: list[Manifest] = field(default_factory=list)

    @property
    def records(self) -> list[Manifest]:
        return [self.base, *self.diffs]


def chains(store: Store) -> list[tuple[Manifest, list[Manifest]]]:
    """Each full checkpoint with the gap-free run of diff records based on it."""
    return chains_of(store.manifests())


def chains_of(ms: list[Manifest]) -> list[tuple[Manifest, list[Manifest]]]:
    """`chains` of the committed records `ms` (a listing's, which may span tiers)."""
    out = []
    for base in (m for m in ms if m.kind == "full"):
        run, nxt = [], base.step + 1
        for d in sorted((m for m in ms if m.kind == "diff" and m.depends_on[:1] == [base.name]),
                        key=lambda m: m.first_step):
            if d.first_step != nxt:
                break
            run.append(d)
            nxt = d.step + 1
        out.append((base, run))
    return out


def plans(store: Store) -> dict[int, Plan]:
    """Every restorable step and its cheapest plan (the nearest base wins)."""
    return plans_of(store.manifests())


def plans_of(ms: list[Manifest]) -> dict[int, Plan]:
    """`plans` of the committed records `ms`."""
    out: dict[int, Plan] = {}
    for base, run in chains_of(ms):
        out[base.step] = Plan(base.step, base)
        for i, d in enumerate(run):
            for s in range(d.first_step, d.step + 1):
                if s not in out or out[s].base.step < base.step:
                    out[s] = Plan(s, base, run[: i + 1])
    return dict(sorted(out.items()))


def restorable(store: Store) -> list[int]:
    return list(plans(store))


def optimizer_classes(trusted: Iterable[str] = ()) -> dict[str, type]:
    """The optimizer classes offline replay may construct, by the name a checkpoint gives them
    (`module.qualname`): torch.optim's own, found by name in torch.optim, plus the classes the
    user names on the command line (`pkg.mod:Class`, the user's explicit trust). A name taken
    from a checkpoint is only ever looked up here, never imported."""
    import torch

    found = [getattr(torch.optim, n) for n in dir(torch.optim)]
    table = {f"{c.__module__}.{c.__qualname__}": c for c in found
             if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer}
    for spec in trusted:
        module, sep, qualname = spec.partition(":")
        try:
            if not (module and sep and qualname):
                raise ValueError("give it as pkg.module:Class")
            cls = importlib.import_module(module)
            for part in qualname.split("."):
                cls = getattr(cls, part)
            if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
                raise ValueError("not a torch.optim.Optimizer subclass")
        except (ImportError, AttributeError, ValueError) as e:
            raise UsageError(f"--optimizer-class {spec}: {e}") from None
        table[f"{cls.__module__}.{cls.__qualname__}"] = table[f"{module}.{qualname}"] = cls
    return table


def _optimizer(index: dict, base: Manifest, rank: int, classes: dict[str, type] | None) -> tuple[type, dict]:
    """(optimizer class, its info) that replay on top of `base` (rank `rank`'s `index`)
    constructs; CorruptCheckpoint if the index names none, or one not in `classes` (None: the
    live optimizer of a resumed run replays, whatever the index names)."""
    info = index["meta"].get("optimizers", {}).get("optimizer")
    if info is None:
        raise CorruptCheckpoint(f"{base.name}: rank {rank} does not say which optimizer to replay with")
    cls = None if classes is None else classes.get(info["class"])
    if cls is None and classes is not None:
        raise CorruptCheckpoint(f"{base.name}: replay needs optimizer class {short(info['class'])}, which is not a "
                                "torch.optim class; if you trust it, pass --optimizer-class pkg.module:Class")
    return cls, info


def _shape(model: type, skeleton: Any, where: str) -> Any:
    try:
        return model.model_validate(skeleton)
    except ValidationError as e:
        raise CorruptCheckpoint(f"{where}: {problem(e)}") from None


def _param_shapes(store: Store, base: Manifest, rank: int, classes: dict[str, type] | None) -> tuple[list, dict]:
    """(the shape of each parameter replay on `base` rebuilds, the base's skeleton);
    CorruptCheckpoint where the base's optimizer class is not allowed or its parameters, state
    and groups do not resolve."""
    index = store.read_index(base.name, rank, base)
    spec = _entries(store, base, rank, index)
    _, info = _optimizer(index, base, rank, classes)
    where = f"{base.name}: rank {rank}"
    state = _shape(StateSkeleton, index["skeleton"], where)
    orphans = state.extra.get(orphans_key("optimizer"), {})
    shapes = []
    for i, aliases in enumerate(info["params"]):
        refs = [state.models.get(model, {}).get(key) for model, key in aliases] if aliases else \
            [orphans.get(str(i)) if isinstance(orphans, dict) else None]
        found = [entry["shape"] if (entry := spec(ref)) is not None else None for ref in refs]
        if None in found or any(shape != found[0] for shape in found):
            raise CorruptCheckpoint(f"{where}: optimizer parameter {i} is not a tensor of the saved state")
        shapes.append(found[0])
    saved = _shape(SavedOptimizer, state.optimizers.get("optimizer"), f"{where} optimizer")
    if any(not 0 <= j < len(shapes) for g in saved.param_groups for j in g.params):
        raise CorruptCheckpoint(f"{where}: an optimizer group names a parameter it does not have")
    return shapes, index["skeleton"]


def _diff_fits(store: Store, diff: Manifest, rank: int, classes: dict[str, type] | None) -> None:
    """CorruptCheckpoint unless every step of `diff` replays on its base: one gradient of the
    parameter's shape (or none, or a sparse pair) per parameter, hyper-parameters per group, and
    post-step state for optimizers and models the base has."""
    base = store.manifest(diff.depends_on[0])
    shapes, base_state = _param_shapes(store, base, rank, classes)
    groups = len(base_state["optimizers"]["optimizer"]["param_groups"])
    index = store.read_index(diff.name, rank, diff)
    spec = _entries(store, diff, rank, index)
    for s, skeleton in index["skeleton"]["steps"].items():
        where = f"{diff.name}: rank {rank} step {s}"
        step = _shape(DiffStep, skeleton, where)
        if len(step.grads) != len(shapes) or len(step.groups) != groups:
            raise CorruptCheckpoint(f"{where}: {len(step.grads)} gradients in {len(step.groups)} groups, its base "
                                    f"{base.name} has {len(shapes)} parameters in {groups}")
        if not set(step.param_groups) <= set(base_state["optimizers"]) or not set(step.buffers) <= set(
                base_state["models"]):
            raise CorruptCheckpoint(f"{where}: names an optimizer or model that {base.name} does not have")
        for i, grad in enumerate(step.grads):
            if grad is not None and not _grad_fits(grad, shapes[i], spec):
                raise CorruptCheckpoint(f"{where}: gradient {i} does not fit parameter {i} {shapes[i]}")


def _entries(store: Store, m: Manifest, rank: int, index: dict) -> Callable[[Any], dict | None]:
    """The index entry of the tensor a reference in rank `rank`'s skeleton (`index`) names: its
    own, or one another rank wrote for it (storage/writeonce.py; that rank's index is read once);
    None where it names no tensor held there."""
    others: dict[int, dict] = {}

    def spec(ref: Any) -> dict | None:
        if not isinstance(ref, dict):
            return None
        if TENSOR in ref:
            return index["tensors"].get(ref[TENSOR])
        if REMOTE not in ref:
            return None
        owner, key = ref[REMOTE]
        if not 0 <= owner < m.world_size or owner == rank:
            return None
        if owner not in others:
            others[owner] = store.read_index(m.name, owner, m)["tensors"]
        return others[owner].get(key)

    return spec


def _grad_fits(grad: Any, shape: list[int], spec: Callable[[Any], dict | None]) -> bool:
    """A recorded gradient (replay.decode_grad): a tensor of the parameter's shape, or a sparse
    {"idx", "val"} pair: as many int32/int64 indices as values, in two 1-D tensors (whether each
    index lies inside the parameter is a value, checked by replay.densify). `spec`: `_entries`."""
    if isinstance(grad, dict) and set(grad) == {"idx", "val"}:
        idx, val = spec(grad["idx"]), spec(grad["val"])
        return idx is not None and val is not None and idx["dtype"] in ("int32", "int64") \
            and len(idx["shape"]) == 1 and idx["shape"] == val["shape"]
    dense = spec(grad)
    return dense is not None and dense["shape"] == shape


def fit_problems(store: Store, m: Manifest, classes: dict[str, type] | None, *, replay: bool,
                 ranks: list[int] | None = None) -> list[str]:
    """What stops restore from assembling a state out of committed record `m`, beyond `m`'s own
    checks (Store.verify_record): a full record's skeleton must be a state, and with `replay`
    (a base that diff records depend on) its optimizer must be rebuildable from `classes` (None:
    by a resumed run's own optimizer); a diff record's steps must replay on its base; the ranks'
    shards of each sharded tensor must make the whole tensor, and a tensor a rank left to another
    (written once) must be there. `ranks`: only those ranks are restored (a node-local --dir's);
    None: all."""
    shards: dict[str, list[Sharded]] = {}
    held: dict[int, set[str]] = {}
    refs: list[tuple[int, int, str]] = []
    try:
        for rank in range(m.world_size) if ranks is None else ranks:
            index = store.read_index(m.name, rank, m)
            held[rank] = set(index["tensors"])
            refs += [(rank, owner, key) for owner, key in remote_refs(index["skeleton"])]
            if m.kind == "diff":
                _diff_fits(store, m, rank, classes)
            elif replay:
                _param_shapes(store, m, rank, classes)
            else:
                _shape(StateSkeleton, index["skeleton"], f"{m.name}: rank {rank}")
                for s in shards_of(index["skeleton"], index["tensors"]):
                    shards.setdefault(s.key, []).append(s)
        for key, pieces in shards.items():  # restore assembles them whole
            choose(pieces, f"{m.name}: sharded tensor {short(key)}")
        for rank, owner, key in refs:  # restore reads them from the rank that wrote them
            if owner == rank or key not in held.get(owner, ()):
                raise CorruptCheckpoint(f"{m.name}: rank {rank} names tensor {short(key)} of rank {owner}, "
                                        "which that rank does not hold")
    except (CorruptCheckpoint, ValueError) as e:
        return [str(e)]
    return []


def verify_problems(store: Store, classes: dict[str, type], *, torn: bool = True) -> list[str]:
    """Everything `ckptrun verify` reports: unreadable manifests, every committed record's own
    problems and what stops restore from using it (`fit_problems`), and with `torn` records
    without a manifest. None means that every restorable step restores (with the same trusted
    optimizer `classes`)."""
    ms = store.manifests(warn=False)
    names = {m.name for m in ms}
    bases = {m.depends_on[0] for m in ms if m.kind == "diff"}
    problems = [*store.unreadable().values()]
    for m in ms:
        problems += store.verify_record(m, names) or fit_problems(store, m, classes, replay=m.name in bases)
    incomplete = store.incomplete() if torn else []
    problems += [f"{name}: incomplete (no manifest; torn or still being written)" for name in incomplete]
    return list(dict.fromkeys(problems))  # a base's problem is found again through each diff on it


class DamagedRecord(CorruptCheckpoint):
    """A record whose tensor checksum failed while a resume read it for replay (`checksums=False`
    chose it): the attempt must end, and the record be set aside, before the next one decides."""

    def __init__(self, message: str, record: str) -> None:
        super().__init__(message)
        self.record = record


def _problems(store: Store, plan: Plan, classes: dict[str, type] | None = None, *,
              checksums: bool = True, ranks: list[int] | None = None) -> tuple[list[str], list[str]]:
    """(what is wrong with the plan's records themselves, what stops assembling the state:
    replay on the base with `classes` (see `fit_problems`), or the base's state alone), for
    `ranks` (None: every rank)."""
    names = {m.name for m in store.manifests(warn=False)}
    own = [p for m in plan.records for p in store.verify_record(m, names, checksums=checksums, ranks=ranks)]
    if own:
        return own, []
    fit = [p for m in plan.records for p in fit_problems(store, m, classes, replay=bool(plan.diffs), ranks=ranks)]
    return own, fit


def missing_part(store: Store, plan: Plan, ranks: list[int]) -> str | None:
    """One line, if a record of `plan` holds no part of one of `ranks` here (a node-local
    --dir, whose other ranks' parts are elsewhere): which ranks it holds, where the rest are."""
    for m in plan.records:
        try:
            held = store.ranks_held(m)
        except CorruptCheckpoint:
            return None  # damaged: said as such by the checks
        if not set(ranks) <= set(held):
            return store.partial(m, held)
    return None


def _checked_ranks(store: Store, plan: Plan, ranks: list[int] | None) -> list[int] | None:
    """The ranks whose parts of `plan` are checked: every rank where all are here (sharded
    tensors are assembled from all of them), else only `ranks` (a node-local --dir)."""
    if ranks is None or missing_part(store, plan, list(range(plan.base.world_size))) is None:
        return None
    return ranks


def newest_good(store: Store, *, at_most: int | None = None, verify: bool = True, checksums: bool = True,
                classes: dict[str, type] | None = None, ranks: list[int] | None = None) -> Plan | None:
    """The newest restorable step (≤ `at_most`) whose records all pass their checks and fit
    together; offline replay (restore) passes the optimizer `classes` it may construct, a
    resumed run (None) replays with its own optimizer. Without `checksums` tensor bytes are not
    read here: the caller reads every byte once, checking them as it goes (a resume that can
    restart, see `DamagedRecord`). `ranks`: only those ranks' parts are needed (a node-local
    --dir); a step whose records do not hold them here is passed over without a warning."""
    bad: set[str] = set()
    for step, plan in reversed(plans(store).items()):
        if at_most is not None and step > at_most or bad & {m.name for m in plan.records}:
            continue
        if ranks is not None and missing_part(store, plan, ranks):
            continue
        need = _checked_ranks(store, plan, ranks)
        own, replay = _problems(store, plan, classes, checksums=checksums, ranks=need) if verify else ([], [])
        problems = own + replay
        if not problems:
            return plan
        # A base that cannot be replayed on may still restore alone.
        bad |= {p.split(":", 1)[0] for p in own} | ({p.split(":", 1)[0] for p in replay} - {plan.base.name})
        log.warning(f"step {step} is damaged ({problems[0]}); falling back to an older step")
    return None


def find(store: Store, step: int | str, classes: dict[str, type] | None = None, rank: int | None = None) -> Plan:
    """The plan for `step` ("latest" falls back past damaged records), of every rank or only
    of `rank` (a node-local --dir holds its own node's ranks' parts)."""
    ranks = None if rank is None else [rank]
    if step == "latest":
        plan = newest_good(store, classes=classes, ranks=ranks)
        if plan is None:
            newest = max(plans(store).items(), default=(0, None))[1]
            partial = newest and ranks and missing_part(store, newest, ranks)
            raise StepNotAvailable(f"rank {rank}: {partial}" if partial else
                                   f"no restorable step in {store.where}" + _available(store))
        return plan
    plan = plans(store).get(int(step))
    if plan is None:
        raise StepNotAvailable(f"step {step} is not committed in {store.where}" + _available(store))
    if ranks and (partial := missing_part(store, plan, ranks)):
        raise StepNotAvailable(f"rank {rank}: {partial}")
    problems = sum(_problems(store, plan, classes, ranks=_checked_ranks(store, plan, ranks)), [])
    if problems:
        good = newest_good(store, at_most=plan.step, classes=classes, ranks=ranks)
        hint = f"; the newest good step before it is {good.step}" if good else "; no good step precedes it"
        raise CorruptCheckpoint(f"step {plan.step} cannot be restored ({problems[0]}){hint}")
    return plan


def _available(store: Store) -> str:
    steps = restorable(store)
    unreadable = list(store.unreadable().values())
    skipped = f"; skipped {unreadable[0]}" + (f" and {len(unreadable) - 1} more" if len(unreadable) > 1 else "") \
        if unreadable else ""
    if not steps:
        return "; it holds no committed steps" + skipped
    return f"; available steps: {_ranges(steps)}" + skipped


def _ranges(steps: list[int]) -> str:
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs_of(steps))


def runs_of(steps: list[int]) -> list[tuple[int, int]]:
    """The runs of consecutive steps in `steps` (ascending), as (first, last)."""
    out: list[tuple[int, int]] = []
    for s in steps:
        if out and s == out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


def read_state(store: Store, m: Manifest, rank: int, *, private: bool = True, into: ReadBuffer | None = None
               ) -> dict:
    """The nested state of `rank` in record `m`, with the replicated tensors other ranks wrote
    (storage/writeonce.py) read from their parts. Tensors are private copies, or with `private`
    False views of buffers read for this call alone (a diff record replay only reads: a copy would
    cost as much as the read; state kept or saved needs its own storage), the rank's own data read
    into `into` (`Store.read_rank`)."""
    try:
        index, tensors = store.read_rank(m, rank, into=into, private=private)
        refs = remote_refs(index["skeleton"])
        remote = {}
        for owner in sorted({o for o, _ in refs}):
            if not (0 <= owner < m.world_size and owner != rank):
                raise CorruptCheckpoint(f"{m.name}: rank {rank} names rank {owner} as the writer of a tensor")
            theirs = store.read_rank(m, owner)[1]
            for o, key in refs:
                if o == owner:
                    if key not in theirs:
                        raise CorruptCheckpoint(f"{m.name}: rank {rank} names tensor {short(key)} of rank {owner}, "
                                                "which that rank does not hold")
                    remote[(o, key)] = theirs[key].clone() if private else theirs[key]
    except CorruptCheckpoint as e:
        raise DamagedRecord(str(e), m.name) from None
    return unflatten(index["skeleton"], tensors, remote)


def resume_state(store: Store, plan: Plan, rank: int, *, check_ahead: bool = False
                 ) -> tuple[dict, Iterator[dict] | None]:
    """What a resume at `plan.step` starts from, and the recorded steps to replay (None without
    diffs). The state is the base's, with the tracked objects' state of `plan.step` itself when
    that is a diff (recorded there, not rebuilt by replay): an object tracked before the
    optimizer exists, i.e. before replay (a framework's loop position), must get the resumed
    step's state, not the base's. Module-less optimized parameters (tracked under `orphans_key`)
    are the exception: replay rebuilds them from the base's values. The last diff record is read
    once, for both. With `check_ahead`, every record is checked before this returns
    (`_check_ahead`); without, the ones between are checked as replay reads them."""
    state = read_state(store, plan.base, rank)
    if not plan.diffs:
        return state, None
    last = read_state(store, plan.diffs[-1], rank)
    if check_ahead:
        _check_ahead(store, plan)
    replayed = {k: v for k, v in state.get("extra", {}).items() if k.startswith(ORPHANS)}
    state["extra"] = {**last["steps"][str(plan.step)]["extra"], **replayed}
    return state, diff_states(store, plan, rank, last=last)


def _check_ahead(store: Store, plan: Plan) -> None:
    """Check every diff record of `plan` before replay starts (DamagedRecord if one fails), by
    hashing it (`Store.verify_record`); replay reads them again. Keeping them in memory instead
    (up to 1 GiB, as this once did) doubled a resumed worker's peak memory and made its restore
    slower, not faster: each kept record faulted fresh pages in before replay could start, where
    the hashing reuses one buffer and replay's reads overlap its optimizer steps (the last
    record is read whole by `resume_state` anyway)."""
    names = {m.name for m in store.manifests(warn=False)}
    for m in plan.diffs[:-1]:
        if problems := store.verify_record(m, names):
            raise DamagedRecord(problems[0], m.name)


def diff_states(store: Store, plan: Plan, rank: int, *, last: dict | None = None) -> Iterator[dict]:
    """The recorded steps base+1..plan.step in order; the next records are read, checked and
    decoded in a thread while the current one is replayed, up to READ_AHEAD_RECORDS and
    READ_AHEAD_BYTES ahead (at least one record). `last`: the last diff record's state, if the
    caller read it already.

    The records between are read into a few buffers used in turn (one per record ahead, one
    replayed): a record's buffer is read into again once its steps are replayed. Fresh buffers
    would fault in every page of every record (half the read time). Nothing replay does keeps a
    gradient past its step (the optimizer reads it; training itself accumulates into the same
    gradient tensors step after step), so the reuse is safe.

    A consumer that stops early (replay failed: a device out of memory, retried on the CPU)
    closes the generator: the reader thread then stops after the record it is reading, and lets
    go of its buffers, rather than wait on a full queue for good."""
    per_record = max(1, max((m.bytes // m.world_size for m in plan.diffs), default=1))
    ahead = max(1, min(READ_AHEAD_RECORDS, READ_AHEAD_BYTES // per_record))
    q: Queue = Queue(maxsize=ahead)
    free: Queue = Queue()
    for _ in range(ahead + 1):
        free.put(ReadBuffer())
    stop = threading.Event()  # the consumer stopped: the reader queues nothing more

    def read(m: Manifest) -> tuple[dict, ReadBuffer | None]:
        """A record's state and the buffer it was read into (to hand back once replayed)."""
        if m is plan.diffs[-1]:  # its post-step state finishes the restored state: its own storage
            return (last if last is not None else read_state(store, m, rank)), None
        buf = free.get()
        if stop.is_set():
            return {}, buf
        return read_state(store, m, rank, private=False, into=buf), buf

    def reader() -> None:
        try:
            for m in plan.diffs:
                if stop.is_set():
                    return
                got = read(m)
                if stop.is_set():
                    return
                q.put(got)
        except BaseException as e:  # handed to the consumer, which re-raises it
            if not stop.is_set():
                q.put((e, None))
            return
        if not stop.is_set():
            q.put((None, None))

    threading.Thread(target=reader, name="ckptrun-diff-reader", daemon=True).start()
    buf = None
    try:
        while True:
            item, buf = q.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            for s in sorted(item["steps"], key=int):
                if int(s) <= plan.step:
                    yield item["steps"][s]
            del item
            if buf is not None:
                free.put(buf)
                buf = None
    finally:
        stop.set()  # (a reader waiting to queue a record, or for a buffer, goes on to see it)
        with contextlib.suppress(Empty):
            while True:
                free.put(q.get_nowait()[1] or ReadBuffer())
        free.put(buf or ReadBuffer())


def finish_state(state: dict, last: dict) -> dict:
    """Step N's state once replay reached N: the post-step parts come from diff N."""
    for name, groups in last["param_groups"].items():
        state["optimizers"][name]["param_groups"] = groups
    for name, buffers in last["buffers"].items():
        state["models"][name].update(buffers)
    return {**state, **{k: last[k] for k in ("rng", "schedulers", "scalers", "extra")}}


def load_state(store: Store, plan: Plan, rank: int, classes: dict[str, type] | None = None) -> dict:
    """The full state of `rank` at `plan.step`, replaying diffs offline when needed (with an
    optimizer class from `classes`, torch.optim's by default)."""
    state = read_state(store, plan.base, rank)
    if not plan.diffs:
        return state
    try:
        return _replay_offline(store, plan, rank, state, optimizer_classes() if classes is None else classes)
    except (AttributeError, KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        if _out_of_memory(e):  # the machine, not the records
            raise CkptrunError(f"not enough memory to replay step {plan.step} of rank {rank} ({_one_line(e)}); "
                               "free memory, or restore it where there is more") from None
        # The records pass their own checks but do not fit together (crafted or mixed runs).
        raise CorruptCheckpoint(f"{plan.base.name}: replaying step {plan.step} failed: its records do not "
                                f"fit together ({type(e).__name__}: {_one_line(e)})") from None


def _out_of_memory(e: BaseException) -> bool:
    """A device's or the host's memory ran out (torch says so by type on a device, by its
    allocator's name in a RuntimeError on the CPU)."""
    import torch

    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and CPU_ALLOCATOR in str(e))


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200]


def build_optimizer(cls: type, info: dict, state: dict, device: Any = None) -> tuple[Any, list]:
    """An optimizer of class `cls` over the parameters of a full `state` (the tensors
    themselves, not copies, unless moved to `device`; `info` says which model entries they are,
    as `Runtime._describe` recorded), with the state's optimizer state loaded (onto its
    parameters' device, as torch.optim places it): what replay steps forward."""
    orphans = state.get("extra", {}).get(orphans_key("optimizer"), {})
    params = [state["models"][a[0][0]][a[0][1]] if a else orphans[str(i)] for i, a in enumerate(info["params"])]
    if device is not None:
        params = [p.to(device) for p in params]
    saved = state["optimizers"]["optimizer"]
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [params[i] for i in g["params"]]}
              for g in saved["param_groups"]]
    opt = cls(groups)
    opt.load_state_dict(saved)
    return opt, params


def _replay_offline(store: Store, plan: Plan, rank: int, state: dict, classes: dict[str, type]) -> dict:
    """Rebuild the optimizer from the base's metadata and replay (no training script needed), on
    the device type the run trained on where this machine has it (`replay_device`); the state
    comes back on the CPU, as read. A device without room for the state replays nothing (the
    state read is the CPU's, untouched): then the CPU does, said in one line."""
    import torch

    from .replay import replay_device

    cls, info = _optimizer(store.read_index(plan.base.name, rank, plan.base), plan.base, rank, classes)
    device = replay_device(info.get("device"))
    try:
        return _replay_on(device, store, plan, rank, state, cls, info)
    except torch.OutOfMemoryError:
        if device.type == "cpu":
            raise
        log.warning(f"warning: {device.type} has no room to replay step {plan.step} of rank {rank}; replayed on "
                    "the CPU, which may differ from the run's by rounding")
        return _replay_on(torch.device("cpu"), store, plan, rank, state, cls, info)


def _replay_on(device: Any, store: Store, plan: Plan, rank: int, state: dict, cls: type, info: dict) -> dict:
    """`_replay_offline` with the optimizer on `device`."""
    from .replay import cpu_state_dict, replay

    opt, params = build_optimizer(cls, info, state, device)
    orphans = state.get("extra", {}).get(orphans_key("optimizer"), {})
    with contextlib.closing(diff_states(store, plan, rank)) as diffs:  # (its reader stops if replay fails)
        last = replay(opt, diffs)
    params = [p.detach().cpu() for p in params]
    for p, aliases in zip(params, info["params"], strict=True):
        for model, key in aliases:
            state["models"][model][key] = p
    state["optimizers"]["optimizer"] = cpu_state_dict(opt)
    state = finish_state(state, last)
    for i in orphans:  # module-less parameters: the replayed values
        state["extra"][orphans_key("optimizer")][i] = params[int(i)]
    return state
