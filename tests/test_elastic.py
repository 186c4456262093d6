"""Elastic re-planning (issue 15): a rank of an 8-rank run is killed mid-training; ``fairscale run
--max-restarts`` starts the script again on the 7 devices left, ``fairscale.train`` re-plans for
them (a global batch of 8 does not split over 7: the plan trains on 4, the other 3 ranks leave),
resumes from the last checkpoint, and finishes with the losses of a fresh run of the new plan from
that checkpoint."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fairscale
from fairscale.runtime.run_cli import run_script
from fairscale.testing.models import build
from planner.plan import Plan

ROOT = Path(__file__).resolve().parents[1]
GPT = dict(layers=2, seq=8, dim=32, vocab=64)
GLOBAL_BATCH = 8
STEPS, EVERY, KILL_AT, VICTIM = 7, 3, 4, 5  # checkpoints after 3 and 6 steps; rank 5 dies in step 4

SCRIPT = textwrap.dedent(f"""
    import json, os, signal, sys
    import fairscale
    from fairscale.testing.models import build

    out = sys.argv[1]
    case = build("gpt", **{GPT!r})
    rank, restart = int(os.environ["RANK"]), fairscale.elastic.restart_count()

    def on_step(step, loss):
        if rank == 0:
            with open(out + ".log", "a") as f:
                f.write(json.dumps([restart, step, loss]) + "\\n")
        if restart == 0 and rank == {VICTIM} and step == {KILL_AT}:
            os.kill(os.getpid(), signal.SIGKILL)  # the device is gone: no traceback, no goodbye

    result = fairscale.train(case.model, lambda step: case.make_batch(step, {GLOBAL_BATCH}), steps={STEPS},
                             loss_fn=case.loss_fn, keep_last=None, on_step=on_step)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(dict(losses=result.losses, resumed_from=result.resumed_from, launched=result.launched,
                           world=int(os.environ["WORLD_SIZE"]), plan=result.plan.to_dict(), restart=restart), f)
""")


def _fresh_run(rank: int, world: int, plan_json: str, checkpoint: str, start: int) -> list[float]:
    """The reference: the new plan, loaded from the checkpoint, trained on its own devices."""
    case = build("gpt", **GPT)
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, GLOBAL_BATCH), loss_fn=case.loss_fn,
                               plan=Plan.from_json(plan_json))
    pm.load_checkpoint(checkpoint)
    losses = []
    for step in range(start, STEPS):
        torch.manual_seed(step)
        losses.append(pm.train_step(case.make_batch(step, GLOBAL_BATCH)))
    return losses


def test_a_killed_rank_replans_on_the_devices_left_and_resumes(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out, checkpoints, err = tmp_path / "result.json", tmp_path / "ckpt", io.StringIO()
    code = run_script(str(script), 8, [str(out)], max_restarts=2, checkpoint_dir=str(checkpoints),
                      checkpoint_every=EVERY, stderr=err)
    log = err.getvalue()
    assert code == 0, log[-4000:]
    assert "died from signal SIGKILL" in log and "restarting on 7 devices (restart 1 of 2; lost rank 5)" in log, log
    result = json.loads(out.read_text())
    plan = Plan.from_dict(result["plan"])
    # the second start: 7 ranks launched; gb 8 splits over dp 1, 2, 4 or 8 only, so the plan uses fewer
    assert result["restart"] == 1 and result["launched"] == 7 and result["resumed_from"] == 3
    assert plan.mesh.size < 7 and GLOBAL_BATCH % plan.mesh.dp == 0 and result["world"] == plan.mesh.size
    steps = [json.loads(line) for line in Path(f"{out}.log").read_text().splitlines()]
    first = {s: loss for r, s, loss in steps if r == 0}
    second = {s: loss for r, s, loss in steps if r == 1}
    assert sorted(first) == [0, 1, 2, 3, 4] and sorted(second) == [3, 4, 5, 6]
    assert result["losses"][:3] == [first[s] for s in range(3)]  # before the checkpoint: as recorded
    assert result["losses"][3:] == [second[s] for s in range(3, STEPS)]
    # steps 3 and 4 ran under both plans (8 ranks, then the new one): the same training within float tolerance
    for s in (3, 4):
        assert abs(first[s] - second[s]) < 1e-5, (s, first[s], second[s])
    fresh = fairscale.launch(_fresh_run, devices=plan.mesh.size,
                             args=(plan.to_json(), str(checkpoints / "step-000003"), 3))
    assert fresh[0] == result["losses"][3:]  # exactly: same plan, same checkpoint, same batches


def _resumes(rank: int, world: int, root: str) -> dict[str, object]:
    case = lambda: build("gpt", **GPT)  # noqa: E731 - a fresh model with the same seed, as a restart builds
    data = case()

    def batches(step: int) -> tuple[torch.Tensor, ...]:
        return data.make_batch(step, GLOBAL_BATCH)

    first = Path(root) / "first"
    a = case()
    stopped = fairscale.train(a.model, batches, steps=3, loss_fn=a.loss_fn, checkpoint_dir=first, checkpoint_every=2,
                              keep_last=1)
    kept_first = sorted(p.name for p in first.iterdir())
    b = case()
    resumed = fairscale.train(b.model, batches, steps=5, loss_fn=b.loss_fn, checkpoint_dir=first)
    c = case()
    seen: dict[str, object] = {}

    def evaluate(step: int, loss: float, pm) -> None:  # a mid-run evaluation of the model itself
        if step == 1:
            batch = batches(9)
            seen["stale"] = _refusal(lambda: c.model(batch[0]))
            pm.gather_into(c.model)
            seen["model"] = float(c.loss_fn(c.model(batch[0]), *batch[1:]))
            seen["pm"] = float(pm.evaluate(batch))

    whole = fairscale.train(c.model, batches, steps=5, loss_fn=c.loss_fn, checkpoint_dir=Path(root) / "whole",
                            on_step=evaluate)
    other = build("gpt", **{**GPT, "dim": 16})
    try:
        fairscale.train(other.model, batches, steps=5, loss_fn=other.loss_fn, checkpoint_dir=first)
        refused = ""
    except (ValueError, RuntimeError) as exc:
        refused = str(exc)
    return dict(stopped=stopped.losses, resumed=resumed.losses, resumed_from=resumed.resumed_from,
                whole=whole.losses, refused=refused, kept_first=kept_first, seen=seen,
                kept=sorted(p.name for p in first.iterdir()))


def _refusal(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return str(exc)
    return "(not refused)"


def test_train_resumes_where_the_last_checkpoint_left_off(tmp_path: Path) -> None:
    """Same plan, stopped after 3 steps and resumed to 5: the losses of an uninterrupted run, exactly;
    keep_last prunes; a checkpoint directory of another model is refused on every rank. The
    uninterrupted run evaluates its model mid-run through on_step's third argument, pm (the model
    is behind its ranks until pm.gather_into), which leaves the training as it was."""
    got = fairscale.launch(_resumes, devices=2, args=(str(tmp_path),))
    for out in got:
        seen = out["seen"]
        assert "In fairscale.train's on_step callback, take pm as its third argument" in seen["stale"]
        assert seen["model"] == pytest.approx(seen["pm"], rel=1e-6)
    zero = got[0]
    assert zero["resumed_from"] == 3 and zero["resumed"] == zero["whole"] and zero["stopped"] == zero["whole"][:3]
    assert zero["kept_first"] == ["elastic.json", "step-000003"]  # keep_last=1: step-000002 pruned
    assert zero["kept"] == ["elastic.json", "step-000003", "step-000005"]  # the default keeps 2
    assert f"{tmp_path / 'first' / 'elastic.json'} records checkpoints of another model" in zero["refused"]
    assert "global rank 0 could not plan the run" in got[1]["refused"] and "another model" in got[1]["refused"]


TORCHRUN_SCRIPT = textwrap.dedent(f"""
    import json, os, sys
    import fairscale
    from fairscale.testing.models import build

    out, steps, checkpoints = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    case = build("gpt", **{GPT!r})
    result = fairscale.train(case.model, lambda step: case.make_batch(step, {GLOBAL_BATCH}), steps=steps,
                             loss_fn=case.loss_fn, checkpoint_dir=checkpoints, checkpoint_every=2)
    if os.environ["RANK"] == "0":
        with open(out, "w") as f:
            json.dump(dict(losses=result.losses, resumed_from=result.resumed_from, launched=result.launched,
                           devices=result.devices), f)
""")


@pytest.mark.slow
def test_torchrun_with_a_new_world_size_replans_and_resumes(tmp_path: Path) -> None:
    """What a torchrun elastic restart does: the script starts again with another WORLD_SIZE (4, then 3
    ranks; torchrun initializes nothing, fairscale.train does) and the same checkpoint directory."""
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for ranks, steps, out in ((4, 2, "a.json"), (3, 4, "b.json")):
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                        str(script), str(tmp_path / out), str(steps), str(tmp_path / "ckpt")],
                       env=env, check=True, capture_output=True, timeout=600)
    a, b = (json.loads((tmp_path / out).read_text()) for out in ("a.json", "b.json"))
    assert a["resumed_from"] is None and b["resumed_from"] == 2 and b["launched"] == 3
    assert b["devices"] <= 3 and GLOBAL_BATCH % b["devices"] == 0  # dp over 3 would not split the batch
    assert b["losses"][:2] == a["losses"] and len(b["losses"]) == 4
