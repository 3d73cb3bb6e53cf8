"""TRAINING PROCESS: bootstrap, the runtime hooked into the optimizer, discovery, patches, integrations."""
