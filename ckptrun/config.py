"""The run configuration the launcher hands to every worker (env CKPTRUN_CONFIG, JSON)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field

from .strategies import DEFAULT

ENV = "CKPTRUN_CONFIG"
RESUME_ENV = "CKPTRUN_RESUME_STEP"
SUN_PATH_MAX = 108  # bytes in a Unix socket's address (sockaddr_un.sun_path), its final NUL included
# What torch elastic sets for a worker (torch 2.13: local_elastic_agent's _start_workers and
# _set_local_rank_env, the error file of multiprocessing.api, the signal list of launcher.api),
# besides every TORCHELASTIC_* name. OMP_NUM_THREADS and CUDA_VISIBLE_DEVICES are set from the
# launcher's own (or to 1 with several processes, or per rank in virtual-local-rank mode).
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


def is_torchrun_var(name: str) -> bool:
    return name in TORCHRUN_ENV or name.startswith("TORCHELASTIC_")


@dataclass
class RunConfig:
    strategy: str = DEFAULT
    dir: str = "ckpts"
    every: int = 1
    keep: int = 2
    resume: bool = True
    on_save_error: str = "warn"
    max_inflight: int = 2
    max_inflight_given: bool = False  # --max-inflight on the command line or a recipe (else the budget may lower it)
    # --host-memory: the node's host-memory budget for staging (bytes; 0: none, e.g. a config from before
    # the flag), where the figure comes from, and the rank's share (the launcher divides by local ranks)
    host_memory_node: int = 0
    host_memory_source: str = ""
    host_memory: int = 0
    host_memory_nlocal: int = 1
    writers: int = 2
    io_threads: int = 1
    io_engine: str = "auto"  # --io-engine: the engine's file writer (ckptrun/storage/iowriter.py)
    engine_dir: str = ""
    authkey: str = ""
    metrics_dir: str = ""
    final_checkpoint: bool = True
    every_auto: bool = False  # --every auto: the interval is chosen online (ckptrun.worker.decisions)
    # --every N given (command line or recipe), not left at its default: every multiple of N must be
    # restorable once the run ends; a strategy maps it onto its own intervals (Entry.explicit_every)
    every_given: bool = False
    # --max-overhead: what checkpointing may cost the training loop, a fraction of the no-checkpoint step
    # (ckptrun/worker/budget.py); 0: no budget (the CLI's default is 5%, a config made elsewhere has none)
    max_overhead: float = 0.0
    mtbf: float = 0.0  # seconds, --mtbf; 0: not given (--every auto then assumes tuning.intervals.DEFAULT_MTBF_S)
    # --mtbf-process/-node/-job (seconds; 0: not given): with --replicas and --node-local-dir, the
    # tiers' model (ckptrun/tuning/levels.py) behind --durable-every auto
    mtbf_kinds: dict = field(default_factory=dict)
    max_steps: int = 0  # --max-steps: stop the script cleanly after this many optimizer steps; 0: no limit
    on_restart: str = "resume"  # --on-restart: resume | fresh | fail, for scripts that do not resume themselves
    # --durable: the remote tier committed steps are drained to (s3://bucket/prefix or a path; "" none),
    # every --durable-every steps (0: auto), --durable-keep full checkpoints kept there (0: all)
    durable: str = ""
    durable_every: int = 0
    durable_keep: int = 2
    durable_endpoint: str = ""  # --durable-endpoint: an S3-compatible service's URL
    # --replicas K: each step also in the memory of K-1 partners' engines on other nodes (1: none);
    # --replica-jump J: a rank's group spans every J-th node (ckptrun/storage/tiers/group.py)
    replicas: int = 1
    replica_jump: int = 1
    # --node-local-dir: each node's --dir is its own, lost with the node (no node reads another's
    # files); a step commits through the job store (ckptrun/engine/nodecommit.py), and each node's
    # --dir holds its ranks' parts
    node_local_dir: bool = False
    options: dict = field(default_factory=dict)  # strategy-specific settings
    dist_env: bool = True  # --no-dist-env: the script sees none of torchrun's variables (one process)
    launcher_env: dict = field(default_factory=dict)  # --no-dist-env: those variables as the launcher had them

    @property
    def interval_auto(self) -> bool:
        """The interval is chosen online: --every auto, or --every left unset under a budget."""
        return self.every_auto or (self.max_overhead > 0 and not self.every_given)

    def engine_address(self, local_rank: int) -> str:
        """The engine's Unix socket: in the run's private folder, or, where that path is longer
        than a socket address holds (a long TMPDIR), the same name in Linux's abstract namespace
        (the connection's authkey guards it there)."""
        path = os.path.join(self.engine_dir, f"engine-{local_rank}.sock")
        if len(os.fsencode(path)) < SUN_PATH_MAX or not sys.platform.startswith("linux"):
            return path
        return f"\0{os.path.basename(self.engine_dir)}-engine-{local_rank}"

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> RunConfig:
        return cls(**json.loads(os.environ[ENV]))
