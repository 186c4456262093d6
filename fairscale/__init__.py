"""fairscale: a declarative auto-parallel compiler for PyTorch, and FairScale's classic modules.

    import fairscale
    pm = fairscale.parallelize(model, devices=8, example_inputs=(batch,))
"""

from planner.plan import Plan, PlanError
from fairscale.runtime.launch import RankFailedError, launch

__version__ = "1.0.0.dev0"

__all__ = ["Plan", "PlanError", "launch", "RankFailedError", "__version__"]
