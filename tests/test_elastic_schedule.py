"""``fairscale.train(..., lr_scheduler=...)``: the schedule is kept in checkpoints (``fairscale.elastic_schedule``).

``fairscale.train`` had no way to keep a scheduler's state: a schedule stepped from ``on_step``
started again from step 0 on a resume (the checkpoint restores the optimizer's rates, not the
scheduler's step count), and the resumed losses left the uninterrupted run's, silently. A run
stopped after 3 steps and resumed to 5 now follows a warmup-then-cosine-restarts schedule exactly;
a resume without the scheduler, or a scheduler the loop does not own, is refused.
"""

from __future__ import annotations

from pathlib import Path

import torch

import fairscale
from fairscale.testing.models import build

GPT = dict(layers=2, seq=8, dim=32, vocab=64)
GLOBAL_BATCH = 8


def _schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    lr = torch.optim.lr_scheduler
    return lr.SequentialLR(optimizer, [lr.LinearLR(optimizer, 0.2, total_iters=2),
                                       lr.CosineAnnealingWarmRestarts(optimizer, 2)], milestones=[2])


def _refusal(fn) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return "(not refused)"


def _rank(rank: int, world: int, root: str) -> dict[str, object]:
    data = build("gpt", **GPT)

    def batches(step: int) -> tuple[torch.Tensor, ...]:
        return data.make_batch(step, GLOBAL_BATCH)

    def run(steps: int, directory: str, **kwargs) -> fairscale.ElasticResult:
        case = build("gpt", **GPT)  # a fresh model with the same seed, as a restart builds
        return fairscale.train(case.model, batches, steps=steps, loss_fn=case.loss_fn,
                               checkpoint_dir=Path(root) / directory, **kwargs)

    stopped = run(3, "cut", lr_scheduler=_schedule, checkpoint_every=2)
    resumed = run(5, "cut", lr_scheduler=_schedule)
    whole = run(5, "whole", lr_scheduler=_schedule)
    plain = run(2, "plain")
    held: dict[str, object] = {}

    def on_step(step: int, loss: float, pm) -> None:  # a scheduler the loop cannot checkpoint
        held.setdefault("scheduler", torch.optim.lr_scheduler.StepLR(pm.optimizer, 1, gamma=0.5))

    return dict(stopped=stopped.losses, resumed=resumed.losses, resumed_from=resumed.resumed_from,
                whole=whole.losses, plain=plain.losses, without=_refusal(lambda: run(6, "cut")),
                on_step=_refusal(lambda: run(2, "on_step", on_step=on_step)))


def test_a_resumed_run_follows_the_schedule_exactly(tmp_path: Path) -> None:
    got = fairscale.launch(_rank, devices=2, args=(str(tmp_path),))
    for out in got:
        assert out["resumed_from"] == 3
        assert out["stopped"] == out["whole"][:3] and out["resumed"] == out["whole"]
        assert out["plain"][1] != out["whole"][1]  # the schedule moved the rate
        assert out["without"].startswith(f"{tmp_path / 'cut' / 'step-000005'} was written by a run with lr_scheduler "
                                         "SequentialLR, and this run has none: "), out["without"]
        assert out["on_step"].startswith("fairscale.train: a learning-rate scheduler (StepLR) drives pm.optimizer, "
                                         "and this run writes checkpoints"), out["on_step"]
        assert "lr_scheduler=lambda optimizer: StepLR(optimizer, ...)" in out["on_step"]
