"""LAUNCHER PROCESS, what the user sees: live dashboard, the metrics feed it reads, host metrics, worker output."""
