"""The optimizer's host cost per parameter tensor (Cluster.optimizer_tensor_s): counted per tensor
the rank's optimizer updates (DDP: every parameter tensor; ZeRO: one shard per bucket; FSDP: one
per unit), and fitted by calibration as a slope."""

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fairscale.runtime.calibrate import fit_slope
from planner.cluster import Cluster
from planner.cost import layer_facts
from planner.cost_gpt import gpt_graph
from planner.cost_memory import OPTIMIZER_ACCESSES, optimizer_step_bytes
from planner.plan import DataParallel, Mesh, Plan, Schedule, Stage
from planner.search import cost_plan


def _plan(dp_kind: str) -> Plan:
    return Plan(mesh=Mesh(pp=1, dp=8, tp=1), stages=[Stage(layers="*")],
                schedule=Schedule(kind="1f1b", microbatches=1), data_parallel=DataParallel(kind=dp_kind))


def test_layer_facts_count_each_parameter_tensor_once():
    g = gpt_graph(layers=2, hidden=64, heads=4, seq=32, vocab=256)
    facts = layer_facts(g, {})
    # 2 embeddings + 2 blocks × 16 (4 attention and 2 MLP linears with bias, 2 norms) + ln_f's 2;
    # the tied head weight is the embedding's (param_shapes lists it under both names): counted once
    assert sum(f.param_tensors for f in facts) == 36 == len(g.param_shapes) - 1
    assert facts[0].param_tensors == 1 and facts[-1].param_tensors == 0


def test_optimizer_pays_per_tensor_it_updates():
    g = gpt_graph(layers=2, hidden=64, heads=4, seq=32, vocab=256)
    c = Cluster.preset("a100-80gb")
    slow = dataclasses.replace(c, optimizer_tensor_s=1e-3)
    n = 36  # parameter tensors, the tied weight once
    base, more = (cost_plan(_plan("ddp"), g, x, validate=False, global_batch=16) for x in (c, slow))
    # DDP: the user's optimizer over every parameter tensor, 1 ms each
    assert more.optimizer_s - base.optimizer_s == pytest.approx(n * 1e-3)
    assert more.step_time_s - base.step_time_s == pytest.approx(n * 1e-3)
    # ZeRO-2: one flat fp32 shard per 25 MB gradient bucket: the model's 0.4 MB is one
    base, more = (cost_plan(_plan("zero2"), g, x, validate=False, global_batch=16) for x in (c, slow))
    assert more.optimizer_s - base.optimizer_s == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="optimizer_tensor_s must be >= 0"):
        dataclasses.replace(c, optimizer_tensor_s=-1.0)


def test_calibration_fits_the_per_tensor_slope():
    # synthetic steps: 250 us fixed + 50 us per tensor
    slope, intercept = fit_slope([(1, 3e-4), (16, 1.05e-3), (64, 3.45e-3)])
    assert slope == pytest.approx(5e-5) and intercept == pytest.approx(2.5e-4)
    # noise that makes the line fall is clamped: no negative cost
    assert fit_slope([(1, 2e-4), (64, 1e-4)])[0] == 0.0


def _accesses(optimizer: torch.optim.Optimizer, n: int) -> int:
    """Distinct n-element tensors each aten op of one ``optimizer.step()`` reads or writes, summed."""
    class Count(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            big = lambda xs: {id(t): t for t in tree_leaves(xs) if isinstance(t, torch.Tensor) and t.numel() == n}  # noqa: E731
            written = big(out)
            for arg, value in zip(func._schema.arguments, args):  # in-place and foreach_*_ ops write their self
                if arg.alias_info is not None and arg.alias_info.is_write:
                    written.update(big(value))
            Count.total += len(big((args, kwargs))) + len(written)
            return out
    with Count():
        optimizer.step()
    return Count.total


@pytest.mark.parametrize("kind,make", [("adam", lambda ps, f: torch.optim.Adam(ps, lr=1e-3, foreach=f)),
                                        ("sgd", lambda ps, f: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=f))])
@pytest.mark.parametrize("foreach", [False, True])
def test_the_optimizer_traffic_is_what_torch_runs(kind, make, foreach):
    # the cost model's accesses per element are counted on torch's own step (one tensor, second step:
    # the first creates the states), per tensor and foreach alike
    n = 1000
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = make([p], foreach)
    opt.step()
    assert _accesses(opt, n) == OPTIMIZER_ACCESSES[kind]
    assert optimizer_step_bytes(kind, "fp32") == 4 * OPTIMIZER_ACCESSES[kind]
    assert optimizer_step_bytes("adam", "bf16") == 18 * 4 + 4 + 2  # the fp32 master copied into bf16


def test_the_optimizer_step_costs_its_traffic_over_the_elements_it_updates():
    g = gpt_graph(layers=2, hidden=64, heads=4, seq=32, vocab=256)
    c = dataclasses.replace(Cluster.preset("a100-80gb"), optimizer_tensor_s=0.0)
    params = sum(f.params for f in layer_facts(g, {}))
    bw = c.hbm_bandwidth * c.efficiency.memory
    ddp, zero2 = (cost_plan(_plan(k), g, c, validate=False, global_batch=16) for k in ("ddp", "zero2"))
    assert ddp.optimizer_s == pytest.approx(params * 72 / bw)  # fp32 Adam: every element, 18 accesses
    assert zero2.optimizer_s == pytest.approx(params / 8 * 72 / bw)  # its 1/8 shard of the states
