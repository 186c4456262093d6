"""A training batch whose shape differs from the captured one is refused with the dimension that
differs and what to do (issue 15, item 5): a wrong sequence length is not called a wrong row count."""

from __future__ import annotations

import re

import pytest

from fairscale.runtime.pipeline import PipelineError, PipelineExecutor
from fairscale.testing.models import build
from passes.split_stages import split_stages_pass
from planner.capture import capture
from planner.plan import DataParallel, Mesh, Plan, Schedule, Stage
from planner.schedule import build_schedule
from planner.selectors import format_layers


@pytest.fixture(scope="module")
def pipe() -> PipelineExecutor:
    case = build("gpt", layers=2, seq=8, dim=32, vocab=64)
    graph = capture(case.model, case.make_batch(0, 2), loss_fn=case.loss_fn, annotate=False)  # 2 rows of 8 tokens
    plan = Plan(mesh=Mesh(pp=1, dp=1), schedule=Schedule(kind="1f1b", microbatches=2),
                stages=[Stage(layers=format_layers([layer.name for layer in graph.layers]))],
                data_parallel=DataParallel(kind="ddp"))
    return PipelineExecutor(split_stages_pass(graph.gm, plan, graph=graph), build_schedule("1f1b", pp=1, microbatches=2))


def test_a_wrong_sequence_length_names_the_dimension(pipe: PipelineExecutor) -> None:
    ids, labels = build("gpt", layers=2, seq=8, dim=32, vocab=64).make_batch(0, 4)
    with pytest.raises(PipelineError) as info:
        pipe.step((ids[:, :6], labels[:, :6]))
    text = str(info.value)
    assert text.startswith("microbatch input 0 has shape [2, 6] but stage 0 was captured for [2, 8]: dim 1 is 6, "
                           "not 8 (a length fixed when parallelize captured the model, such as the sequence length); "
                           "give every batch the example batch's shape beyond dim 0 (pad or cut dim 1 to 8)"), text
    assert "rows" not in text


def test_a_wrong_global_batch_names_the_rows(pipe: PipelineExecutor) -> None:
    batch = build("gpt", layers=2, seq=8, dim=32, vocab=64).make_batch(0, 6)
    with pytest.raises(PipelineError, match=re.escape(
            "microbatch input 0 has shape [3, 8] but stage 0 was captured for [2, 8]: 3 rows per microbatch instead "
            "of 2 (global batch / (dp × microbatches)); train with the global batch the plan was made for")):
        pipe.step(batch)
