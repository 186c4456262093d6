"""``fairscale.fair_dev``: FairScale 0.4.13's development helpers (``fair_dev.testing``), kept so
test suites written against 0.4.13 run unchanged."""
