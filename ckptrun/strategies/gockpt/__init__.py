"""gockpt (not yet a registered strategy): its corrected stall model, used by `ckptrun tune`."""
