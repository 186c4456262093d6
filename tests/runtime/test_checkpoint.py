"""DCP checkpoints of data-parallel rank graphs: resume at another world size and kind, atomic
writes, and the full / sharded state dicts in the user's keys."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

import fairscale
from fairscale.runtime.checkpoint import CheckpointSaveError, checkpoint_path, load_checkpoint, save_checkpoint
from fairscale.data_parallel import DataParallelRunner
from fairscale.testing.reference import Trajectory, compare, train_reference
from planner.capture import capture

from dp_harness import GLOBAL_BATCH, config, make_case

FAMILY = "gpt"


def _graph(world):
    case = make_case(FAMILY)
    return case, capture(case.model, case.make_batch(0, GLOBAL_BATCH // world), loss_fn=case.loss_fn, annotate=False)


def _np(state):
    return {k: v.numpy() for k, v in state.items()}


def test_resume_on_half_the_ranks_matches_uninterrupted_training(tmp_path):
    """fsdp on 4 ranks trains 2 steps and saves; zero2 and ddp on 2 ranks load it and take step 3:
    the result equals 3 uninterrupted single-process steps (losses and parameters)."""
    ref = train_reference(lambda: make_case(FAMILY), steps=3, global_batch=GLOBAL_BATCH)
    case4, graph4 = _graph(4)
    case2, graph2 = _graph(2)
    ckpt = tmp_path / "ckpt"

    def first(rank, world):
        r = DataParallelRunner.build(graph4, config(FAMILY, "fsdp_reshard"), torch.optim.Adam, lr=1e-2)
        losses = [r.train_step(case4.make_batch(s, GLOBAL_BATCH)) for s in range(2)]
        save_checkpoint(ckpt, r.gm, optimizer=r.optimizer)
        return losses

    def second(rank, world, kind):
        r = DataParallelRunner.build(graph2, config(FAMILY, kind), torch.optim.Adam, lr=1e-2)
        load_checkpoint(ckpt, r.gm, optimizer=r.optimizer)
        loss = r.train_step(case2.make_batch(2, GLOBAL_BATCH))
        return loss, _np(r.full_state_dict())

    losses = fairscale.launch(first, devices=4)[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no .tmp / .prev left behind
    for kind in ("zero2", "ddp"):
        loss, params = fairscale.launch(second, devices=2, args=(kind,))[0]
        compare(ref, Trajectory(losses + [loss], {k: torch.from_numpy(v) for k, v in params.items()}))


def test_a_crash_mid_save_keeps_the_previous_checkpoint(tmp_path):
    case, graph = _graph(2)
    ckpt = tmp_path / "ckpt"

    def run(rank, world):
        import torch.distributed.checkpoint as dcp

        r = DataParallelRunner.build(graph, config(FAMILY, "fsdp_keep"), torch.optim.Adam, lr=1e-2)
        r.train_step(case.make_batch(0, GLOBAL_BATCH))
        save_checkpoint(ckpt, r.gm, optimizer=r.optimizer)
        saved = _np(r.full_state_dict(rank0_only=False))
        r.train_step(case.make_batch(1, GLOBAL_BATCH))
        original = dcp.FileSystemWriter.write_data

        def dying_write(self, plan, planner):  # rank 1's disk fails while the new save is written
            if rank == 1:
                raise OSError("disk full (simulated)")
            return original(self, plan, planner)

        dcp.FileSystemWriter.write_data = dying_write
        try:
            with pytest.raises(CheckpointSaveError, match=r"rank 1: OSError\('disk full.*the previous checkpoint"):
                save_checkpoint(ckpt, r.gm, optimizer=r.optimizer)
        finally:
            dcp.FileSystemWriter.write_data = original
        after_crash = _np(r.full_state_dict(rank0_only=False))
        load_checkpoint(ckpt, r.gm, optimizer=r.optimizer)
        return saved, after_crash, _np(r.full_state_dict(rank0_only=False))

    saved, after_crash, loaded = fairscale.launch(run, devices=2)[0]
    assert checkpoint_path(ckpt) == ckpt
    assert any(not np.array_equal(saved[k], after_crash[k]) for k in saved)  # the step moved weights
    for k in saved:
        np.testing.assert_array_equal(loaded[k], saved[k])


def test_a_crash_between_the_renames_falls_back_to_prev(tmp_path):
    case, graph = _graph(2)
    ckpt = tmp_path / "ckpt"

    def save(rank, world):
        r = DataParallelRunner.build(graph, config(FAMILY, "zero1"), torch.optim.Adam, lr=1e-2)
        save_checkpoint(ckpt, r.gm, optimizer=r.optimizer)
        return _np(r.full_state_dict())

    def load(rank, world):
        r = DataParallelRunner.build(graph, config(FAMILY, "ddp"), torch.optim.Adam, lr=1e-2)
        with torch.no_grad():
            for p in r.gm.parameters():
                p.zero_()
        load_checkpoint(ckpt, r.gm, optimizer=r.optimizer)
        return _np(r.full_state_dict())

    saved = fairscale.launch(save, devices=2)[0]
    shutil.move(ckpt, tmp_path / "ckpt.prev")  # the state after "path -> path.prev", before "tmp -> path"
    assert checkpoint_path(ckpt) == tmp_path / "ckpt.prev"
    loaded = fairscale.launch(load, devices=2)[0]
    for k in saved:
        np.testing.assert_array_equal(loaded[k], saved[k])
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        checkpoint_path(tmp_path / "missing")


def test_full_state_dict_roundtrip_and_tied_keys():
    """The gathered state dict has the user's keys (both names of the tied embedding) and loads back."""
    case, graph = _graph(4)
    expected = {k: v.detach().clone() for k, v in case.model.state_dict().items()}

    def run(rank, world):
        out = {}
        for kind in ("ddp", "zero1", "zero2", "fsdp_reshard"):
            r = DataParallelRunner.build(graph, config(FAMILY, kind), torch.optim.Adam, lr=1e-2)
            full = r.full_state_dict(rank0_only=False)
            r.train_step(case.make_batch(0, GLOBAL_BATCH))
            r.load_full_state_dict(full)  # back to the initial weights
            out[kind] = (_np(full), _np(r.full_state_dict()))
        return out

    results = fairscale.launch(run, devices=4)
    assert all(r is not None for r in results)
    for kind, (before, after) in results[0].items():
        assert set(before) == set(expected), kind
        for k, v in expected.items():
            np.testing.assert_array_equal(before[k], v.numpy())
            np.testing.assert_array_equal(after[k], v.numpy())
    assert results[1]["fsdp_reshard"][1] == {}  # rank0_only by default


def test_a_file_at_the_checkpoint_path_is_refused_on_every_rank(tmp_path):
    """The runtime's own save (not only ``pm.save_checkpoint``): a file where the checkpoint goes was
    found by rank 0 alone, in the commit after the write, while the others waited in a barrier."""
    case, graph = _graph(2)
    notes = tmp_path / "notes.txt"
    notes.write_text("the user's notes")

    def run(rank, world):
        r = DataParallelRunner.build(graph, config(FAMILY, "zero2"), torch.optim.Adam, lr=1e-2)
        r.train_step(case.make_batch(0, GLOBAL_BATCH))
        with pytest.raises(CheckpointSaveError, match=f"{notes} is a file, and a checkpoint is a directory; nothing "
                                                      "was written"):
            save_checkpoint(notes, r.gm, optimizer=r.optimizer)
        save_checkpoint(tmp_path / "ckpt", r.gm, optimizer=r.optimizer)  # the ranks are still in step
        return r.train_step(case.make_batch(1, GLOBAL_BATCH))

    losses = fairscale.launch(run, devices=2, collective_timeout_s=30)
    assert losses[0] == losses[1] and notes.read_text() == "the user's notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "notes.txt"]
