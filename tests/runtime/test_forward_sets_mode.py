"""A forward that puts a submodule in eval mode itself: distillation's frozen teacher.

Knowledge-distillation code calls ``self.teacher.eval()`` inside its forward (so that the training
loop's ``model.train()`` cannot switch the teacher's batch norm and dropout to training). The
runtime's mode check (``fairscale.runtime.modes``) compared every module's flag with the one
recorded before the capture, whose forward had just set the teacher to eval: every rank of a
script that built its model and called ``fairscale.parallelize`` crashed at its first
``pm.train_step`` with ``ModeError: ... module teacher (Sequential) is in eval mode, but was in
training mode when fairscale.parallelize compiled it``. The capture now notes the modules whose
mode the forward sets (``planner.mode_setters``), and the check leaves them out: the graph holds
them in the forward's mode whatever their flag, as one process runs them.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from fairscale.testing.models import Case
from fairscale.testing.reference import Trajectory, compare_grads, train_reference
from planner.capture import capture
from planner.mode_setters import MODES_SET
from planner.plan import Mesh, Plan, Schedule
from refusals import refused

PLAN = Plan(mesh=Mesh(dp=2), schedule=Schedule(kind="1f1b", microbatches=1))


class Distill(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Sequential(nn.Linear(12, 24), nn.BatchNorm1d(24), nn.ReLU(), nn.Dropout(0.3),
                                     nn.Linear(24, 6))
        self.teacher.requires_grad_(False)
        self.student = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 6))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.teacher.eval()
        with torch.no_grad():
            t = self.teacher(x)
        s = self.student(x)
        kd = F.kl_div(F.log_softmax(s / 4, dim=1), F.softmax(t / 4, dim=1), reduction="batchmean")
        return kd * 16 * 0.9 + F.cross_entropy(s, labels) * 0.1


def _batch(step: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, 12, generator=g), torch.randint(0, 6, (rows,), generator=g)


def _case() -> Case:
    torch.manual_seed(0)
    return Case("distill", Distill(), _batch, None)


def test_the_capture_notes_the_modules_whose_mode_the_forward_sets() -> None:
    graph = capture(_case().model, _batch(0), annotate=False)
    assert graph.extra[MODES_SET] == ["teacher", "teacher.0", "teacher.1", "teacher.2", "teacher.3", "teacher.4"]


def _train(rank: int, world: int) -> dict[str, object]:
    model = _case().model
    pm = fairscale.parallelize(model, example_inputs=_batch(0), plan=PLAN,
                               optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    out = Trajectory()
    for step in range(3):
        model.train()  # a training loop's habit; the forward sets the teacher back to eval
        out.losses.append(pm.train_step(_batch(step)))
        if step == 0:
            out.grads = pm.full_grads()
    model.student.eval()  # a module the forward does not set is still checked
    return {"trajectory": out, "student in eval mode": refused(lambda: pm.train_step(_batch(0)))}


def test_distillation_trains_as_one_process_with_the_teacher_set_to_eval_in_forward() -> None:
    reference = train_reference(_case, steps=3, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    got = fairscale.launch(_train, devices=2)[0]
    compare_grads(reference, got["trajectory"])
    assert "module student (Sequential) is in eval mode" in got["student in eval mode"], got
