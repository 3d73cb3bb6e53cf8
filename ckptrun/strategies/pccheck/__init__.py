"""pccheck (not yet a registered strategy): its (N*, f*) tuning model, used by `ckptrun tune`."""
