"""``fairscale run``'s script runner: a data-parallel training script on forked CPU ranks."""

from __future__ import annotations

import io
import json
import textwrap

from fairscale.runtime.run_cli import run_script

SCRIPT = textwrap.dedent('''
    import json, sys
    import torch, torch.distributed as dist
    from fairscale.data_parallel import DataParallelRunner
    from fairscale.testing.models import build
    from planner.capture import capture
    from planner.plan import DataParallel

    out, steps = sys.argv[1], int(sys.argv[2])
    case = build("mlp")
    world = dist.get_world_size()
    graph = capture(case.model, case.make_batch(0, 8 // world), loss_fn=case.loss_fn, annotate=False)
    runner = DataParallelRunner.build(graph, DataParallel(kind="fsdp", units="layers.*"), torch.optim.Adam, lr=1e-2)
    losses = [runner.train_step(case.make_batch(s, 8)) for s in range(steps)]
    with open(f"{out}.{dist.get_rank()}", "w") as f:
        json.dump({"world": world, "losses": losses}, f)
''')


def test_a_script_runs_on_every_rank_with_its_arguments(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "result"
    assert run_script(str(script), 2, [str(out), "2"]) == 0
    results = [json.loads((tmp_path / f"result.{r}").read_text()) for r in range(2)]
    assert results[0] == results[1] and results[0]["world"] == 2 and len(results[0]["losses"]) == 2


def test_a_failing_rank_gives_a_nonzero_status_and_its_traceback(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("import torch.distributed as dist\n"
                      "if dist.get_rank() == 1:\n    raise ValueError('bad batch on rank 1')\n"
                      "import sys\nsys.exit(0)\n")
    err = io.StringIO()
    assert run_script(str(script), 2, [], stderr=err) == 1
    assert "rank 1 failed first" in err.getvalue() and "ValueError: bad batch on rank 1" in err.getvalue()


def test_exit_status_and_missing_script(tmp_path):
    script = tmp_path / "exit3.py"
    script.write_text("import sys\nsys.exit(3)\n")
    err = io.StringIO()
    assert run_script(str(script), 2, [], stderr=err) == 1
    assert "exited with status 3 on rank" in err.getvalue()
    err = io.StringIO()
    assert run_script(str(tmp_path / "nope.py"), 2, [], stderr=err) == 2
    assert "no such script" in err.getvalue()
