"""Views that change the dtype (``aten.real``, ``view_as_complex``) keep it in every repeated block.

The annotator caches an op's facts by its argument shapes and dtypes, and rebuilds a cached
output that aliases an input as a view of that input. It rebuilt it with the input's dtype, so in
the second block of Hugging Face's FNet (``torch.fft.fftn(x).real`` then ``LayerNorm``) the
``real`` output was complex and the capture was refused ("native_layer_norm does not support
complex inputs"); a Llama written with ``view_as_complex`` rotary got float32 facts for its
complex values in every block after the first, silently.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import fairscale
from fairscale.testing.models import Case
from fairscale.testing.reference import Trajectory, compare_grads, train_reference
from planner.capture import capture
from planner.graph import META_VAL

BATCH, SEQ, DIM, STEPS, LR = 4, 8, 16, 3, 0.1


class Fourier(nn.Module):
    """FNet's mixing (real part of a 2-D FFT) and a rotary written with complex numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x + torch.fft.fftn(x, dim=(1, 2)).real)
        angles = torch.arange(SEQ * DIM // 2, dtype=x.dtype).reshape(SEQ, DIM // 2)
        rotated = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2)) * torch.polar(torch.ones_like(angles), angles)
        return self.proj(torch.view_as_real(rotated).flatten(2))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Fourier() for _ in range(3))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return nn.functional.mse_loss(self.head(x).squeeze(-1), y)


def _batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, SEQ, DIM, generator=g), torch.randn(n, SEQ, generator=g)


@pytest.mark.parametrize("replicate", [True, False])
def test_every_block_keeps_the_dtypes_of_its_views(replicate: bool) -> None:
    torch.manual_seed(0)
    graph = capture(Stack(), _batch(0, BATCH), replicate=replicate)
    dtypes: dict[str, list[torch.dtype]] = {}
    for node in graph.gm.graph.nodes:
        name = getattr(node.target, "__name__", "")
        if name in ("real.default", "view_as_complex.default", "view_as_real.default"):
            dtypes.setdefault(name, []).append(node.meta[META_VAL].dtype)
    assert dtypes == {"real.default": [torch.float32] * 3, "view_as_complex.default": [torch.complex64] * 3,
                      "view_as_real.default": [torch.float32] * 3}


def _fnet(seed: int) -> Case:
    transformers = pytest.importorskip("transformers")
    from fairscale.testing.corpus_hf import Labels, _masked

    torch.manual_seed(seed)
    config = transformers.FNetConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                                     max_position_embeddings=16, hidden_dropout_prob=0.0, pad_token_id=127,
                                     bos_token_id=126, eos_token_id=125)
    return Case("hf-fnet", Labels(transformers.FNetForMaskedLM(config)), _masked, None)


def _train(rank: int, world: int, case: Case) -> Trajectory:
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn,
                               devices=world, optimizer=functools.partial(torch.optim.SGD, lr=LR))
    out = Trajectory()
    for step in range(STEPS):
        out.losses.append(pm.train_step(case.make_batch(step, BATCH)))
        if step == 0:
            out.grads = pm.full_grads()
    return out


def test_hf_fnet_default_config_trains_exactly_on_two_ranks() -> None:
    case = _fnet(0)
    reference = train_reference(lambda: _fnet(0), steps=STEPS, global_batch=BATCH,
                                optimizer=lambda params: torch.optim.SGD(params, lr=LR))
    got = fairscale.launch(_train, devices=2, args=(case,))[0]
    compare_grads(reference, got)
