"""Layers of a model without a repeated block, under a wrapper (planner.layers.group_layers).

HF ALBERT shares one layer's weights across depth (``albert_layer_groups.0`` called once per
layer), so it has no repeated container. Under the one-attribute wrapper users write (and the
corpus uses: ``Labels(model)``), every node ran in ``inner``, which became the one layer of the
graph: ``pp=2`` was refused with "pp=2 is more than the 1 layers", naming nothing and saying
nothing to do. The layers are now the children of the deepest module every node runs in
(``inner.albert``, ``inner.predictions``, as without the wrapper), HF ALBERT trains exactly under
pp2 x tp2 and pp2 x dp2, and a pipeline longer than the layers is refused naming them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from fairscale.api import captured
from planner.layers import _common_root
from planner.plan import PlanError


class SharedDepth(nn.Module):
    """ALBERT in small: an embedding, ONE block applied at every depth, a head, the loss inside."""

    def __init__(self, depth: int = 2) -> None:
        super().__init__()
        self.depth = depth
        self.embed, self.block, self.head = nn.Embedding(32, 16), nn.Linear(16, 16), nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for _ in range(self.depth):
            x = x + torch.tanh(self.block(x))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


class Wrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.inner(ids, labels)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (8, 8), generator=g)
    return ids, ids.roll(1, dims=1)


def test_the_common_root_is_the_deepest_module_with_two_children_that_run() -> None:
    assert _common_root(["inner", "inner.albert.embeddings", "inner.albert.encoder", "inner.predictions"]) == "inner"
    assert _common_root(["albert.embeddings", "predictions", ""]) == ""  # unwrapped: unchanged
    assert _common_root(["inner.linear"]) == ""  # one module runs everything: one layer
    assert _common_root([]) == ""


def test_a_wrapped_model_without_a_repeated_block_has_its_children_as_layers() -> None:
    torch.manual_seed(0)
    graph = captured(Wrapper(SharedDepth()), _batch())
    assert [layer.name for layer in graph.layers] == ["inner.embed", "inner.block", "inner.head"]
    unwrapped = captured(SharedDepth(), _batch())
    assert [layer.name for layer in unwrapped.layers] == ["embed", "block", "head"]


def test_pp_longer_than_the_layers_is_refused_naming_them() -> None:
    torch.manual_seed(0)
    with pytest.raises(PlanError) as info:
        fairscale.plan(Wrapper(SharedDepth()), _batch(), devices=4, constraints={"mesh": {"pp": 4, "dp": 1, "tp": 1}})
    text = str(info.value)
    assert "pp=4 is more than the 3 layer(s)" in text and "module inner.embed, inner.block, inner.head" in text, text
    assert "use mesh.pp of at most 3" in text, text


def test_hf_albert_under_a_wrapper_trains_exactly_under_a_pipeline() -> None:
    transformers = pytest.importorskip("transformers")
    from fairscale.testing.corpus_hf import Labels

    torch.manual_seed(0)
    config = transformers.AlbertConfig(vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=2, intermediate_size=64, max_position_embeddings=8)
    model = Labels(transformers.AlbertForMaskedLM(config))
    ids, labels = _batch()
    report = fairscale.check(model, (ids, labels), devices=2,
                             constraints={"mesh": {"pp": 2, "dp": 1, "tp": 1}, "schedule": {"microbatches": 2}})
    assert report.plan.mesh.pp == 2 and report.ok, report
