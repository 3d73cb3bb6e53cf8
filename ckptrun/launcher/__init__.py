"""LAUNCHER PROCESS: `ckptrun run` — the elastic agent, engine supervision, the console."""
