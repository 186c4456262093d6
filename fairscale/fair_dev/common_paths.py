"""Where FairScale's development scripts cache downloaded data sets (``~/.cache/fairscale``).

Nothing in this package downloads anything; the path is kept for scripts that import it.
"""

from pathlib import Path

DATASET_CACHE_ROOT = str(Path.home() / ".cache" / "fairscale" / "datasets")
