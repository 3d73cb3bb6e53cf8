"""Measure, on this machine, the per-rank costs that ckptrun's global commit is made of, so that
docs/scale.md can model commit latency and per-rank write time up to thousands of ranks.

    python examples/scale_probe.py --dir /path/on/the/checkpoint/fs [--ranks 1,16,64,256,1024]
        [--mb 64] [--tensors 150] [--json out.json]

It times ckptrun's own code paths, not re-implementations:
- `Store.write_rank` (one rank's part: data and index, each temp -> fsync -> rename -> fsync dir),
  for a 4 KiB part (the fixed cost) and an `--mb` part (bandwidth);
- `publish_json` of a manifest (temp -> fsync -> rename -> fsync dir);
- `Store.try_commit` by the committing rank over N ranks' parts (list the record, read and hash
  every rank's index, publish the manifest), each index holding `--tensors` tensors;
- `Store.is_committed` (the stat every other rank's engine polls every 50 ms);
- `Regions.scan` over N ranks' region files (what every engine of pccheck and lightcheck does
  to see a step committed);
- a TCPStore set and get round trip over loopback (the job store: resume agreement, decisions).
Medians of `--repeat` runs. Everything it writes goes under `--dir` and is removed at the end.

It then prints the model of docs/scale.md from those numbers (`--from out.json` prints it again
from a saved measurement): per-rank write time and commit latency for 1 to 4096 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from ckptrun.storage.fsutil import publish_json
from ckptrun.storage.iowriter import select
from ckptrun.storage.region import Geometry, Regions, RegionWriter
from ckptrun.storage.store import Store, full_name, rank_index


def median_s(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def tensors(count: int) -> dict[str, dict]:
    """An index's tensor table: `count` small float32 tensors (what a rank's index lists)."""
    return {f"model.layer{i}.weight": {"dtype": "float32", "shape": [4], "offset": 4096 * i, "nbytes": 16}
            for i in range(count)}


def write_cost(store: Store, nbytes: int, ntensors: int, repeat: int) -> float:
    """Seconds for one rank's part of a record, `nbytes` of data, through the engine's writer."""
    data = memoryview(bytearray(os.urandom(1 << 20)) * max(1, nbytes >> 20))[:nbytes]
    table = {k: v for k, v in tensors(ntensors).items() if v["offset"] + v["nbytes"] <= nbytes}
    names = iter(range(10**6))

    def one() -> None:
        store.write_rank(full_name(next(names) + 1), 0, data, table, {"model": {}}, {})

    return median_s(one, repeat)


def commit_cost(root: Path, nranks: int, ntensors: int, repeat: int) -> float:
    """Seconds the committing rank spends in `try_commit` once N ranks' parts are there."""
    store = Store(root)
    table = tensors(ntensors)
    data = memoryview(bytes(4096 * ntensors))
    results = []
    for attempt in range(repeat):
        name = full_name(10_000 + attempt)
        rdir = root / name
        rdir.mkdir()
        raw = json.dumps(rank_index(name, 0, data, table, {"model": {}}, {}), indent=1)
        for r in range(nranks):  # the parts, without fsync: only the commit is timed
            (rdir / f"rank-{r:05d}.data").write_bytes(b"")
            (rdir / f"rank-{r:05d}.json").write_text(raw.replace('"rank": 0', f'"rank": {r}', 1))
        t0 = time.perf_counter()
        m = store.try_commit(name, kind="full", step=10_000 + attempt, first_step=10_000 + attempt,
                             world_size=nranks)
        results.append(time.perf_counter() - t0)
        assert m is not None
        shutil.rmtree(rdir)
    return statistics.median(results)


def region_scan_cost(root: Path, nranks: int, repeat: int) -> float:
    """Seconds for one `Regions.scan` over N ranks' region files (5 slots each, one committed)."""
    rdir = root / f"regions-{nranks}"
    rdir.mkdir()
    index_raw = json.dumps({"rank": 0, "tensors": {}}).encode()
    for r in range(nranks):
        w = RegionWriter(rdir, r, 0, Geometry(nslots=5, slot_bytes=4096, meta_bytes=65536))
        w.write_meta(0, counter=1, step=1, world_size=nranks, data_nbytes=0, index_raw=index_raw, meta={},
                     written_at=time.time())
        w.publish(1, 0, 1)
        os.close(w.fd)
    regions = Regions(rdir)
    cost = median_s(regions.scan, repeat)
    assert [m.step for m in regions.scan()[0]] == [1]
    shutil.rmtree(rdir)
    return cost


def store_round_trip(repeat: int) -> dict[str, float]:
    """Seconds for a TCPStore set and a get over loopback (one client, the server in this process)."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
    client.set("k", "0")
    return {"set_s": median_s(lambda: client.set("k", "1"), repeat),
            "get_s": median_s(lambda: client.get("k"), repeat)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".", help="a folder on the file system the checkpoints go to")
    p.add_argument("--ranks", default="1,16,64,256,1024")
    p.add_argument("--mb", type=int, default=64, help="size of the large per-rank part")
    p.add_argument("--tensors", type=int, default=150, help="tensors in each rank's index")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", default="", help="also write the results here")
    p.add_argument("--from", dest="saved", default="",
                   help="print the model only, from saved measurements (A.json,B.json,...: their medians)")
    p.add_argument("--state-mb", type=float, default=55.4, help="model: replicated state size S")
    p.add_argument("--node-ranks", type=int, default=8, help="model: ranks per node (hierarchical commit)")
    args = p.parse_args()
    if args.saved:
        print_model(medians([json.loads(Path(f).read_text()) for f in args.saved.split(",")]), args.state_mb,
                    args.node_ranks)
        return
    root = Path(tempfile.mkdtemp(prefix="scale-probe-", dir=args.dir))
    try:
        store = Store(root)
        store.ensure_writable()
        manifest = {"name": "step-00000001", "index_checksums": {str(r): "0" * 16 for r in range(2)}}
        big = args.mb << 20
        out = {
            "io_engine": select("auto"),
            "write_4k_s": write_cost(store, 4096, args.tensors, args.repeat),
            f"write_{args.mb}mb_s": write_cost(store, big, args.tensors, args.repeat),
            "manifest_publish_s": median_s(lambda: publish_json(root / "m.json", manifest), args.repeat),
            "is_committed_s": median_s(lambda: [store.is_committed("step-00000009") for _ in range(1000)],
                                       args.repeat) / 1000,
            **store_round_trip(max(200, args.repeat)),
            "commit_s": {}, "region_scan_s": {},
        }
        out["MBps"] = args.mb / out[f"write_{args.mb}mb_s"]
        out["commit_small_s"] = {}
        for n in map(int, args.ranks.split(",")):
            out["commit_s"][n] = commit_cost(root, n, args.tensors, args.repeat)
            out["commit_small_s"][n] = commit_cost(root, n, 1, args.repeat)
            out["region_scan_s"][n] = region_scan_cost(root, n, args.repeat)
            print(f"N={n}: try_commit {out['commit_s'][n] * 1e3:.2f} ms ({args.tensors} tensors per index), "
                  f"{out['commit_small_s'][n] * 1e3:.2f} ms (1), region scan {out['region_scan_s'][n] * 1e3:.2f} ms",
                  flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print_model(out, args.state_mb, args.node_ranks)


def medians(runs: list[dict]) -> dict:
    """Each number's median over several runs of the probe (nested per rank count)."""
    first = runs[0]
    return {k: medians([r[k] for r in runs]) if isinstance(v, dict) else
            statistics.median(r[k] for r in runs) if isinstance(v, float) else v for k, v in first.items()}


def fit(points: dict) -> tuple[float, float]:
    """Least-squares (a, b) of seconds = a + b * N over the measured rank counts (a at least 0)."""
    xs, ys = [float(n) for n in points], list(points.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return max(0.0, my - b * mx), b


TICK_S = 0.05  # the engines' commit loop period (engine/server.py commit_loop)


def print_model(m: dict, state_mb: float, node_ranks: int) -> None:
    """docs/scale.md's table: per-rank write time of a `state_mb` replicated state written by
    every rank (today) and once (S/N per rank), the committing rank's work C(N), the latency
    from the last rank's part durable to every rank told, hierarchical commit per node of
    `node_ranks` ranks, and pccheck/lightcheck's scan of every rank's region per engine tick."""
    a, b = fit(m["commit_s"])
    a1, b1 = fit(m["commit_small_s"])
    c, d = fit(m["region_scan_s"])
    fixed, bw = m["write_4k_s"], m["MBps"]
    print(f"\nC(N) = {a * 1e3:.2f} ms + {b * 1e3:.3f} ms * N; with 1-tensor indexes {a1 * 1e3:.2f} + "
          f"{b1 * 1e3:.3f} * N; region scan {c * 1e3:.2f} + {d * 1e3:.3f} * N ms; per-rank part fixed "
          f"{fixed * 1e3:.1f} ms + S / {bw:.0f} MB/s; state S = {state_mb:.0f} MB; node = {node_ranks} ranks\n")
    print("| ranks N | write, S per rank (s) | write, S/N per rank (s) | C(N) (s) | commit latency (s) "
          "| hierarchical C (s) | region scan per tick (s) |")
    print("|---|---|---|---|---|---|---|")
    for n in (1, 8, 64, 256, 1024, 4096):
        cn = a + b * n
        nodes = -(-n // node_ranks)
        hier = (a + b * min(n, node_ranks)) + (a1 + b1 * nodes if nodes > 1 else 0.0)
        print(f"| {n} | {fixed + state_mb / bw:.3f} | {fixed + state_mb / n / bw:.3f} | {cn:.3f} | "
              f"{TICK_S + cn:.3f} | {hier:.3f} | {c + d * n:.3f} |")


if __name__ == "__main__":
    main()
