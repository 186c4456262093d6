"""Every tensor the runtime and the passes create names its device, and steps make no hidden host syncs.

No GPU is lent to CI, so the device contract is proven on CPU in two complementary ways:

* **Real ranks under a factory guard** (``device_guard.DeviceGuard``): one 8-rank gloo launch runs a
  plan of every kind (DDP, ZeRO-1, ZeRO-2, FSDP with offload, every pipeline schedule, TP with SP,
  EP, 3-D) through ``parallelize``, three steps, ``state_dict`` and a checkpoint round trip, with
  any factory call from ``passes/`` or ``fairscale/runtime/`` that lacks ``device=`` raising. The
  trajectories must still match one process exactly (float64, as ``tests/test_parallelize.py``).
  The same run counts host syncs during the second step: only the allowed sites may appear, as often
  as documented.
* **Rank graphs compiled for the meta device** (``test_rank_graphs_run_entirely_on_the_target_device``):
  a fake process group lets one process compile rank graphs of several mesh shapes for
  ``device="meta"``, and a dispatch mode checks that every op of forward and backward sees only
  meta tensors: a tensor the passes left on the CPU (a parameter, a buffer, or a device the capture
  baked into a graph node, like ``arange(..., device=cpu)``) fails by name.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fairscale
from device_guard import DeviceGuard
from fairscale.api import captured, parallelize
from fairscale.compile_check import checker_for
from fairscale.testing.models import Case, build
from fairscale.testing.reference import Trajectory, compare, train_reference, start_again
from passes.tp.patterns import propose_tp_rules
from planner.plan import DataParallel, Mesh, Plan, Schedule, Stage, TensorParallel
from planner.selectors import format_layers

STEPS, BATCH, LR = 3, 8, 1e-3


def _gpt() -> Case:
    case = build("gpt", layers=4)
    case.model.to(torch.float64)
    make = case.make_batch
    return dataclasses.replace(case, make_batch=lambda step, n: tuple(
        t.to(torch.float64) if t.is_floating_point() else t for t in make(step, n)))


def _mixtral() -> Case:
    case = build("mixtral", layers=2, experts=4)
    case.model.to(torch.float64)
    for layer in case.model.model.layers:
        layer.mlp.experts.float()  # transformers' grouped matmul has no float64 kernel
    make = case.make_batch

    def loss64(out: Any, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), labels.reshape(-1))

    return dataclasses.replace(case, loss_fn=loss64, make_batch=lambda step, n: tuple(
        t.to(torch.float64) if t.is_floating_point() else t for t in make(step, n)))


FAMILIES = {"gpt": _gpt, "mixtral": _mixtral}

# name: (family, pp, dp, tp, ep, schedule, microbatches, dp kind, extra data-parallel options, sequence parallel)
PLANS = {
    "3d-1f1b-ddp": ("gpt", 2, 2, 2, 1, "1f1b", 2, "ddp", {}, False),
    "interleaved-zero1": ("gpt", 2, 4, 1, 1, "interleaved", 2, "zero1", {}, False),
    "gpipe-zero2-sp": ("gpt", 2, 2, 2, 1, "gpipe", 2, "zero2", {}, True),
    "v-fsdp-offload": ("gpt", 2, 2, 2, 1, "v", 4, "fsdp", {"offload": True}, False),
    "ep-zero2": ("mixtral", 1, 4, 2, 2, "1f1b", 1, "zero2", {}, False),
}
CHECKPOINTED = "gpipe-zero2-sp"
SLOW_PLANS = ("3d-1f1b-ddp", "interleaved-zero1")
"""Run with -m slow, in a launch of their own: the default tier keeps a pipeline with tp, sequence
parallelism and ZeRO-2, the V schedule with FSDP offload, and expert parallelism."""

ALLOWED_SYNCS = {
    # the step's loss, returned to the caller as a float: one per step
    ("fairscale/runtime/pipeline.py", "_report_loss"): "1 per step",
    # a token-mean loss: each piece's labels counted, read to the host at once (passes.loss_count)
    ("passes/loss_count.py", "count_all"): "1 per step",
    # all_to_all takes split sizes as host ints: one copy of the routing table per MoE layer forward
    ("passes/ops/ep_ops.py", "_route"): "1 per MoE layer per microbatch forward",
}


def _stages(layers: list[str], n: int) -> list[Stage]:
    blocks = [i for i, name in enumerate(layers) if ".layers." in f".{name}."]
    per = len(blocks) // n
    cuts = [0] + [blocks[per * k] for k in range(1, n)] + [len(layers)]
    return [Stage(layers=format_layers(layers[a:b])) for a, b in zip(cuts, cuts[1:])]


def _plan(graph: Any, config: tuple) -> Plan:
    family, pp, dp, tp, ep, kind, micro, dp_kind, extra, sp = config
    v = 2 if kind in ("interleaved", "v") else 1
    rules = {k: r for k, r in propose_tp_rules(graph.gm, tp=tp, sequence_parallel=sp).rules.items()
             if not (ep > 1 and r == "expert")} if tp > 1 else {}
    units = ("model.layers.*" if family == "mixtral" else "layers.*") if dp_kind == "fsdp" else ""
    return Plan(mesh=Mesh(pp=pp, dp=dp, tp=tp, ep=ep),
                schedule=Schedule(kind=kind, microbatches=micro, virtual_stages=v, global_batch=BATCH),
                stages=_stages([layer.name for layer in graph.layers], pp * v) if pp > 1 else [],
                tensor_parallel=TensorParallel(rules=rules, sequence_parallel=sp),
                data_parallel=DataParallel(kind=dp_kind, units=units, **extra))


def _run(rank: int, world: int, cases: dict[str, Case], plans: dict[str, tuple[str, Plan]], ckpt: str,
         ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (family, plan) in plans.items():
        case = cases[family]  # the user's code (model and data) runs outside the guard
        batches = [case.make_batch(step, BATCH) for step in range(STEPS)]
        guard = DeviceGuard()
        with guard:
            start_again(case.model)  # each plan from the model's initial weights
            pm = parallelize(case.model, example_inputs=batches[0], loss_fn=case.loss_fn, plan=plan,
                             optimizer=functools.partial(torch.optim.Adam, lr=LR))
            losses = [pm.train_step(batches[0])]
            guard.counting = True
            losses.append(pm.train_step(batches[1]))
            guard.counting = False
            losses.append(pm.train_step(batches[2]))
            state = pm.state_dict()
            if name == CHECKPOINTED:
                pm.save_checkpoint(ckpt)
                pm.load_checkpoint(ckpt)
                state_after = pm.state_dict()
                if rank == 0:
                    assert state_after.keys() == state.keys()
                    assert all(torch.equal(state_after[k], state[k]) for k in state), "the round trip changed weights"
        devices = {str(p.device) for p in pm.parameters()}
        out[name] = dict(trajectory=Trajectory(losses=losses, params=state), syncs=dict(guard.syncs),
                         devices=devices, microbatches=plan.schedule.microbatches)
    return out


def _guarded(tmp_path_factory, names: list[str]):
    # The models are built and the plans checked here, before the launch, as after fairscale.search:
    # the ranks inherit the models and the check's captures (parallelize never changes a model, so
    # one model serves every plan) and compile and run every plan under the guard.
    families = {PLANS[name][0] for name in names}
    cases = {f: FAMILIES[f]() for f in families}
    graphs = {f: captured(c.model, c.make_batch(0, BATCH), loss_fn=c.loss_fn) for f, c in cases.items()}
    plans = {name: (PLANS[name][0], _plan(graphs[PLANS[name][0]], PLANS[name])) for name in names}
    for family, plan in plans.values():
        checker_for(cases[family].model, cases[family].make_batch(0, BATCH), loss_fn=cases[family].loss_fn).check(plan)
    refs = {f: train_reference(FAMILIES[f], steps=STEPS, global_batch=BATCH, lr=LR) for f in families}
    ckpt = str(tmp_path_factory.mktemp("guard") / "ckpt")
    results = fairscale.launch(_run, devices=8, args=(cases, plans, ckpt), timeout_s=1200)
    return refs, results


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """slow -> (references, per-rank results) of that tier's plans, one launch per tier, on first use."""
    cache: dict[bool, Any] = {}

    def get(slow: bool) -> Any:
        if slow not in cache:
            cache[slow] = _guarded(tmp_path_factory, [name for name in PLANS if (name in SLOW_PLANS) == slow])
        return cache[slow]

    return get


TIERED = [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_PLANS else name for name in PLANS]


@pytest.mark.parametrize("name", TIERED)
def test_every_plan_kind_runs_with_every_factory_on_an_explicit_device(guarded, name):
    refs, results = guarded(name in SLOW_PLANS)
    family = PLANS[name][0]
    got = results[0][name]
    compare(refs[family], got["trajectory"], rtol=1e-10 if family == "gpt" else 1e-5,
            atol=1e-9 if family == "gpt" else 1e-5)
    for r in results:
        assert r[name]["devices"] == {"cpu"}


@pytest.mark.parametrize("name", TIERED)
def test_a_step_makes_only_the_documented_host_syncs(guarded, name):
    _, results = guarded(name in SLOW_PLANS)
    layers = 2  # MoE layers of the mixtral case
    for rank, r in enumerate(results):
        syncs = r[name]["syncs"]
        unexpected = {site: n for site, n in syncs.items() if site not in ALLOWED_SYNCS}
        assert not unexpected, f"rank {rank}: host syncs in a step at {unexpected}"
        assert syncs.get(("fairscale/runtime/pipeline.py", "_report_loss")) == 1
        assert syncs.get(("passes/loss_count.py", "count_all"), 0) <= 1
        routes = syncs.get(("passes/ops/ep_ops.py", "_route"), 0)
        assert routes == (layers * r[name]["microbatches"] if PLANS[name][4] > 1 else 0)


class _OnlyOn(TorchDispatchMode):
    """Fail on any op that sees a tensor off ``device`` (0-d CPU scalars mix with any device, as on GPUs)."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = torch.device(device)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for t in tree_leaves((args, kwargs)):
            scalar = isinstance(t, torch.Tensor) and t.dim() == 0 and t.device.type == "cpu"
            if isinstance(t, torch.Tensor) and t.device != self.device and not scalar:
                raise AssertionError(f"{func} got a tensor on {t.device} {tuple(t.shape)}; everything must be on "
                                     f"{self.device}")
        return func(*args, **(kwargs or {}))


# family, pp=1 mesh (dp, tp), dp kind, sequence parallel
META_PLANS = [("gpt", 2, 2, "fsdp", True), ("gpt", 4, 1, "zero2", False), ("llama", 2, 2, "zero1", True),
              ("llama", 1, 4, "ddp", False), ("t5", 2, 1, "fsdp", False), ("bert", 1, 2, "ddp", False)]


def _meta_ranks(rank: int, world: int) -> list[str]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fairscale.runtime.mesh import build_mesh
    from passes import compile_rank
    from planner.capture import capture

    dist.destroy_process_group()  # this rank's gloo world: one fake world per mesh shape instead
    done = []
    for family, dp, tp, kind, sp in META_PLANS:
        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=dp * tp)
        mesh, _ = build_mesh(1, dp, tp, device_type="cpu")
        with mesh.groups.active():
            case = build(family)
            graph = capture(case.model, case.make_batch(0, 2), loss_fn=case.loss_fn, annotate=False)
            rules = propose_tp_rules(graph.gm, tp=tp, sequence_parallel=sp).rules if tp > 1 else {}
            units = "layers.*" if family in ("gpt", "llama") else ("block.*" if family == "t5" else "")
            plan = Plan(mesh=Mesh(dp=dp, tp=tp), tensor_parallel=TensorParallel(rules=rules, sequence_parallel=sp),
                        data_parallel=DataParallel(kind=kind, units=units if kind == "fsdp" else ""))
            _, modules = compile_rank(graph, plan, stages=[0], dp_index=mesh.dp_index, tp_index=mesh.tp_index,
                                      device="meta")
            gm = modules[0]
            stale = [n for n, t in [*gm.named_parameters(), *gm.named_buffers()] if not t.is_meta]
            assert not stale, f"{family} {kind} dp={dp} tp={tp}: {stale[:3]} not on the target device"
            batch = tuple(t.to("meta") for t in case.make_batch(0, 2))  # the captured (per-rank) shape
            with _OnlyOn("meta"):
                out = gm(*batch)
                loss = out[0] if isinstance(out, (tuple, list)) else out
                loss.backward()
            done.append(f"{family}-{kind}-dp{dp}-tp{tp}")
            dist.destroy_process_group()
    return done


def test_rank_graphs_run_entirely_on_the_target_device():
    got = fairscale.launch(_meta_ranks, devices=1, timeout_s=600)[0]
    assert got == [f"{f}-{k}-dp{dp}-tp{tp}" for f, dp, tp, k, _ in META_PLANS]
