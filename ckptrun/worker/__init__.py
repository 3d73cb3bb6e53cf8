"""TRAINING PROCESS: bootstrap, the runtime and its parts (docs/architecture.md, "Inside a worker"),
discovery, patches, integrations."""
