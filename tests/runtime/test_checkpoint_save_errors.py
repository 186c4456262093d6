"""``pm.save_checkpoint`` to a place it cannot write is refused on every rank before anything is
written, and training goes on in step. A file at the checkpoint's path had failed on rank 0 alone,
in the commit after the write (``NotADirectoryError`` without a path, the user's file moved to
``<path>.prev``), leaving the other ranks in a barrier until the collective timeout."""

from __future__ import annotations

from pathlib import Path

import torch

import fairscale
from fairscale.testing.models import build
from planner.plan import Mesh, Plan, Schedule


def _rank(rank: int, world: int, where: str) -> dict[str, object]:
    case = build("mlp")
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, 4), loss_fn=case.loss_fn,
                               plan=Plan(mesh=Mesh(dp=2), schedule=Schedule(microbatches=1)))
    pm.train_step(case.make_batch(0, 4))
    out: dict[str, object] = {}
    try:
        pm.save_checkpoint(str(Path(where) / "notes.txt"))
        out["file"] = "(saved)"
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        out["file"] = f"{type(exc).__name__}: {exc}"
    pm.save_checkpoint(str(Path(where) / "ckpt"))  # the ranks are still in step
    out["loss"] = pm.train_step(case.make_batch(1, 4))
    return out


def test_a_file_at_the_checkpoint_path_is_refused_on_every_rank_and_kept(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("the user's notes")
    results = fairscale.launch(_rank, devices=2, args=(str(tmp_path),), collective_timeout_s=30)
    for out in results:
        assert out["file"] == (f"CheckpointSaveError: cannot save a checkpoint at {notes}: {notes} is a file, and a "
                               "checkpoint is a directory; nothing was written: pass the path of a directory (new, "
                               "or a checkpoint to replace)"), out["file"]
    assert results[0]["loss"] == results[1]["loss"]
    assert notes.read_text() == "the user's notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "notes.txt"]
    assert torch.isfinite(torch.tensor(results[0]["loss"]))
