"""The watchdog (issue 15): no wait outlives ``collective_timeout_s``, and the ranks that give up
name the rank they waited for and where it is.

* Every group the runtime makes carries the world's timeout (torch gives new groups 30 minutes).
* A rank stuck alive in a pp × dp × tp plan on 8 ranks (sleeping in a forward hook of its stage,
  or between two steps; rank 0 too, which hosts the store the ranks report to) ends the job within
  ``collective_timeout_s`` + 10 s, and every rank that reports names it, with the collective, step
  and schedule action each waited on, from the ranks' flight records.
* When every rank is in a collective (a collective posted on some ranks only), the error says they
  wait on each other.
"""

from __future__ import annotations

import functools
import os
import time

import pytest
import torch

import fairscale
from fairscale.api import captured, parallelize
from fairscale.compile_check import checker_for
from fairscale.runtime.mesh import build_mesh
from fairscale.runtime.p2p import Message, exchange
from fairscale.testing.models import build
from passes.ops import comm
from passes.tp.patterns import propose_tp_rules
from planner.plan import DataParallel, Mesh, Plan, Schedule, Stage, TensorParallel
from planner.selectors import format_layers

TIMEOUT = 10.0  # short, and above any setup step one rank runs while the others wait (see _plan)


def _timeouts(rank: int, world: int) -> dict[str, float]:
    mesh, _ = build_mesh(2, 2, 1, ep=2)
    with mesh.groups.active():
        return {axis: comm.get_group(axis)._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                for axis in ("pp", "dp", "ep", "ep_rep") if comm.get_group(axis) is not None}


def test_every_group_of_the_mesh_carries_the_collective_timeout() -> None:
    got = fairscale.launch(_timeouts, devices=4, collective_timeout_s=7.0)
    assert got == [{"pp": 7.0, "dp": 7.0, "ep": 7.0}] * 4  # ep_rep is a single rank when dp = ep


def _plan(case) -> Plan:
    graph = captured(case.model, case.make_batch(0, 8), loss_fn=case.loss_fn)
    names = [layer.name for layer in graph.layers]
    cut = names.index("layers.2")
    plan = Plan(mesh=Mesh(pp=2, dp=2, tp=2), schedule=Schedule(kind="1f1b", microbatches=2, global_batch=8),
                stages=[Stage(layers=format_layers(names[:cut])), Stage(layers=format_layers(names[cut:]))],
                tensor_parallel=TensorParallel(rules=propose_tp_rules(graph.gm, tp=2).rules),
                data_parallel=DataParallel(kind="ddp"))
    # parallelize's compile check runs on rank 0 while the others wait in a broadcast; checked here
    # once, the forked ranks find the verdict, so no setup step outlasts the short timeout
    assert checker_for(case.model, case.make_batch(0, 8), loss_fn=case.loss_fn).refusal(plan) is None
    return plan


def _stuck(rank: int, world: int, case, plan: Plan, stuck: int, in_hook: bool, stamp: str) -> None:
    pm = parallelize(case.model, example_inputs=case.make_batch(0, 8), loss_fn=case.loss_fn, plan=plan,
                     optimizer=functools.partial(torch.optim.Adam, lr=1e-3))
    pm.train_step(case.make_batch(0, 8))

    def hang(*_: object) -> None:  # alive, holding no lock, never reaching the next collective
        with open(stamp, "w") as f:
            f.write(repr(time.time()))
        time.sleep(3600)

    if rank == stuck and in_hook:
        next(iter(pm.modules.values())).register_forward_pre_hook(hang)
    elif rank == stuck:
        hang()
    pm.train_step(case.make_batch(1, 8))


# stuck rank: (in a forward hook of its stage or between two steps, its place, where it was last)
STUCK = {3: (True, "pp 0, dp 1, tp 1", "step 1, F0@0"),
         0: (False, "pp 0, dp 0, tp 0", "step 0, after the pipeline (optimizer, clipping)"),  # hosts the store
         5: (True, "pp 1, dp 0, tp 1", "step 1, F0@1")}


@pytest.mark.parametrize("stuck", [3, 0, pytest.param(5, marks=pytest.mark.slow)])
def test_a_stuck_rank_ends_the_job_with_its_name_within_the_timeout(tmp_path, stuck: int) -> None:
    in_hook, place, last = STUCK[stuck]
    stamp = str(tmp_path / "stuck_at")
    case = build("gpt", layers=4)
    with pytest.raises(fairscale.RankFailedError) as info:
        fairscale.launch(_stuck, devices=8, args=(case, _plan(case), stuck, in_hook, stamp),
                         collective_timeout_s=TIMEOUT, grace_s=3)
    ended = time.time()
    assert os.path.exists(stamp), f"rank {stuck} never got stuck: {info.value}"
    assert ended - float(open(stamp).read()) < TIMEOUT + 10
    failures = info.value.failures
    assert stuck not in failures and len(failures) >= 1  # the stuck rank is stopped, not blamed for failing
    first = next(iter(failures.values()))
    assert "CollectiveTimeoutError: rank" in first and " gave up after waiting " in first, first
    for tb in failures.values():
        # later failures may be a peer that closed its connection on the way out: explained alike
        head = tb[tb.index("Error: rank "):]
        assert f"(collective_timeout_s = {TIMEOUT:g}) for " in head and ", step 1, " in head.splitlines()[0], head
        assert ("Stuck outside communication (in compute, data loading or user code such as a hook), or slower than "
                f"the timeout: rank {stuck} ({place}) is in no collective: its last was ") in head, head
        assert f"; it was last at {last}." in head, head
        assert "This rank's last collectives, oldest first:" in head and "WAITING for" in head, head


def _mismatch(rank: int, world: int) -> None:
    mesh, _ = build_mesh(2, 1, 1)
    with mesh.groups.active():
        # both ranks receive first: neither sends
        got = Message(False, 1 - rank, torch.empty(3), "x", "RF0@0")
        exchange([got], group=comm.get_group("pp"), axis="pp").wait()


def test_ranks_waiting_on_each_other_are_told_so() -> None:
    with pytest.raises(fairscale.RankFailedError) as info:
        fairscale.launch(_mismatch, devices=2, collective_timeout_s=3.0, grace_s=3)
    text = "\n".join(info.value.failures.values())
    assert "Every rank is in a collective, so they wait on each other" in text, text
