"""Choosing when to checkpoint: `ckptrun tune` (profile, plan, report), interval formulas,
durations, recipes."""
