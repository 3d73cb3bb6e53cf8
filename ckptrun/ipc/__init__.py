"""THE PROCESS BOUNDARY between a training worker and its engine: messages, the client, shared-memory slots.

Torch-free: the engine and the launcher import it without importing torch.
"""
