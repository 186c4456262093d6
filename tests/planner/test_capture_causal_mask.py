"""nn.Transformer given a tgt_mask (the PyTorch tutorials' way) is captured with torch.export: torch
compares the mask's values with a causal mask to choose a kernel, which a trace cannot do (export
failed at `bool((mask == causal).all())` and the model could not be planned at all)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from planner.capture import capture


class Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.transformer = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                          dim_feedforward=32, dropout=0.0)
        self.out = nn.Linear(16, 32)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mask = self.transformer.generate_square_subsequent_mask(tgt.shape[0])
        y = self.transformer(self.emb(src), self.emb(tgt), src_mask=None, tgt_mask=mask)
        return F.cross_entropy(self.out(y).flatten(0, 1), labels.flatten())


def test_nn_transformer_with_a_tgt_mask_is_exported_and_computes_the_same_loss() -> None:
    torch.manual_seed(0)
    model = Seq2Seq()
    src, tgt, labels = torch.randint(0, 32, (5, 3)), torch.randint(0, 32, (6, 3)), torch.randint(0, 32, (6, 3))
    graph = capture(model, (src, tgt, labels))
    assert graph.tracer == "export" and "fallback_from" not in graph.extra
    assert torch.allclose(graph.gm(src, tgt, labels), model(src, tgt, labels), rtol=1e-6, atol=0)
    # outside a trace the mask is still recognised as causal (torch's kernel choice is unchanged)
    from torch.nn.modules.transformer import _detect_is_causal_mask
    assert _detect_is_causal_mask(model.transformer.generate_square_subsequent_mask(4)) is True
