"""CPU conftest for FairScale 0.4.13's own test suite (copied to the root of the run's workspace as
``conftest.py`` by ``run.py``; it is the same file for the original package and for ours).

What it changes, and nothing else:

* Spawned tests run at world sizes 1 and 2 on gloo. The suite sizes its spawned tests by the number
  of CUDA devices (``fair_dev.testing.testing.get_world_sizes``), which is 0 on CPU, so without this
  every ``spawn_for_all_world_sizes`` test would pass vacuously. ``torch_spawn([n])`` tests keep the
  world size they name. The suite's own ``dist_init`` already picks gloo when CUDA is absent.
* One intra-op thread per process: ranks share the machine's cores.

It imports the package under test only through the suite's public testing module, so whichever
``fairscale`` the interpreter imports is the one measured (the run prints its version).
"""

import os

import torch

WORLD_SIZES = [int(w) for w in os.environ.get("CONFORMANCE_WORLD_SIZES", "1,2").split(",")]

torch.set_num_threads(1)

try:
    from fairscale.fair_dev.testing import testing as _testing
except ImportError as e:  # reported per test file by the collection errors; nothing to patch
    _testing = None
    print(f"conformance conftest: fairscale.fair_dev.testing.testing not importable ({e})")

if _testing is not None:
    _testing.get_world_sizes = lambda: list(WORLD_SIZES)
    spawn = _testing.spawn_for_all_world_sizes
    if spawn.__defaults__:
        # the default argument was evaluated at import time from the CUDA device count
        defaults = list(spawn.__defaults__)
        defaults[0] = list(WORLD_SIZES)
        spawn.__defaults__ = tuple(defaults)


def pytest_report_header(config):
    import fairscale

    return f"conformance: fairscale {getattr(fairscale, '__version__', '?')} from {fairscale.__file__}; " \
           f"torch {torch.__version__}; world sizes {WORLD_SIZES}"
