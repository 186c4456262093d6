"""``fairscale.experimental``: FairScale 0.4.13's experimental namespace (``fairscale.experimental.nn``)."""
