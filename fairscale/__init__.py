"""fairscale: a declarative auto-parallel compiler for PyTorch, and FairScale's classic modules.

    import fairscale

    def train(rank, world):
        pm = fairscale.parallelize(model, example_inputs=batch)    # capture → plan → passes
        for step in range(steps):
            loss = pm.train_step(next_batch(step))

    fairscale.launch(train, devices=8)       # or run the script under torchrun

The classic FairScale modules keep their import paths: ``fairscale.nn``, ``fairscale.optim``,
``fairscale.experimental``.
"""

from planner.gc_budget import fewer_collections

with fewer_collections():  # importing torch and the passes makes ~400 collector passes, 0.3 s of them walking it all
    from fairscale.api import parallelize, plan, search, switch_plan
    from fairscale.check import CheckFailed, check
    from fairscale.elastic import ElasticResult, train
    from fairscale.runtime.engine import ParallelModule
    from fairscale.runtime.launch import RankFailedError, launch
    from passes.ops.comm import COUNTER as comm_counter
    from planner.cluster import Cluster
    from planner.plan import Plan, PlanError

__version__ = "1.0.0.dev0"

__all__ = ["parallelize", "plan", "search", "switch_plan", "check", "CheckFailed", "launch", "train", "ElasticResult", "ParallelModule", "Plan", "PlanError",
           "Cluster", "RankFailedError", "comm_counter", "__version__"]
