"""lowdiff: every step's gradient as a differential checkpoint (trainer side, engine side, tuning model)."""
