"""``pm(*batch)`` in the plain loop checks the batch against the shapes the plan was captured for, as
``train_step`` does (``fairscale.runtime.pipeline_io.split_microbatches``).

A DataLoader's smaller last batch or a collator that pads to the longest sequence had reached the
rank graph, whose shapes are fixed at capture: the step crashed inside aten (``shape '[4, 32, 4,
16]' is invalid for input of size 6144``) or, for a graph whose fixed sizes happened to fit, ran on
a reshaped batch. It is now refused before the forward, saying which dim differs and what to do.
"""

from __future__ import annotations

import functools

import pytest
import torch

import fairscale
from fairscale.testing.models import build
from planner.plan import Mesh, Plan, Schedule

from refusals import BATCH, DP2, refused


def _rank(rank: int, world: int) -> dict[str, object]:
    case = build("gpt")
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn, plan=DP2,
                               optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    x, y = case.make_batch(1, BATCH)
    out = {"last batch": refused(lambda: pm(x[:6], y[:6]).backward()),
           "shorter sequence": refused(lambda: pm(x[:, :12], y[:, :12]).backward())}
    case.model.eval()
    with torch.no_grad():
        out["validation, last batch"] = refused(lambda: pm(x[:6], y[:6]))
    case.model.train()
    loss = pm(x, y)
    loss.backward()
    out["then the right shape"] = float(loss.detach())
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, object]]:
    return fairscale.launch(_rank, devices=2, timeout_s=600)


def test_a_batch_of_other_shapes_is_refused_before_the_forward(runs) -> None:
    for out in runs:
        for key in ("last batch", "validation, last batch"):
            assert out[key].startswith("PipelineError: microbatch input 0 has shape [3, 32] but stage 0 was captured "
                                       "for [4, 32]: 3 rows per microbatch instead of 4"), out[key]
        text = out["shorter sequence"]
        assert text.startswith("PipelineError: microbatch input 0 has shape [4, 12] but stage 0 was captured for "
                               "[4, 32]: dim 1 is 12, not 32"), text
        assert "pad or cut dim 1 to 32" in text, text
        assert isinstance(out["then the right shape"], float)


def _train_step_rank(rank: int, world: int) -> str:
    import transformers

    from fairscale.testing.corpus_hf import Labels

    torch.manual_seed(0)
    model = Labels(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)))
    x = torch.randint(0, 64, (BATCH, 16), generator=torch.Generator().manual_seed(0))
    one_row = Plan(mesh=Mesh(dp=2), schedule=Schedule(kind="1f1b", microbatches=1, global_batch=2))
    pm = fairscale.parallelize(model, example_inputs=(x[:2], x[:2].clone()), plan=one_row,
                               optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    return refused(lambda: pm.train_step((x[:4], x[:4].clone())))


def test_train_step_checks_the_shapes_before_counting_the_labels() -> None:
    """A token-mean loss's label counter ran on the batch before its shapes were checked: a batch of
    4 rows given to a plan made for 2 (as a batch of 8 to ``fairscale plan --devices 4`` records a global batch of 4)
    crashed on every rank inside aten ('view size is not compatible with input tensor's size and
    stride') in passes/loss_count.py, on an HF-style Llama."""
    for text in fairscale.launch(_train_step_rank, devices=2, timeout_s=600):
        assert text.startswith("PipelineError: microbatch input 0 has shape [2, 16] but stage 0 was captured for "
                               "[1, 16]"), text
        assert "2 rows per microbatch instead of 1" in text, text
