"""Random numbers drawn outside torch while a model is traced are refused (planner.host_random).

Hugging Face's Wav2Vec2 / HuBERT (default config: ``mask_time_prob=0.05``) draw their SpecAugment
time masks with ``np.random``. Traced, the mask drawn at plan time became a constant of the graph:
every step and every rank trained with that one mask (eager losses of one batch 0.69439, 0.69405,
0.69459; the graph's 0.69406 each time), silently. The capture now refuses such a model, naming
the numpy call, the module and the source line.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from torch import nn

from planner.capture import CaptureError, capture


class NumpyNoise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.from_numpy(np.random.rand(*x.shape) > 0.1).to(x.dtype)
        return (self.net(x) * keep).pow(2).mean()


class PythonNoise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x * random.random()).pow(2).mean()


class TorchNoise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net, self.drop = nn.Linear(8, 8), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.net(x)).pow(2).mean()


def test_a_numpy_draw_is_refused_naming_the_call_module_and_line() -> None:
    with pytest.raises(CaptureError) as info:
        capture(NumpyNoise(), (torch.randn(4, 8),), annotate=False)
    text = str(info.value)
    assert "draws random numbers outside torch" in text, text
    assert "op numpy.random.rand at module <model top level> (NumpyNoise), source test_host_random.py:" in text, text
    assert np.random.rand.__self__ is np.random.mtrand._rand  # the watch puts numpy back


def test_a_python_random_draw_is_refused_naming_the_call_module_and_line_and_torch_random_ops_are_not() -> None:
    """A seq2seq's teacher forcing drawn per step (bentrevett's ``random.random() < ratio`` in its
    forward) was refused as 'op random.* (its global state moved; where was not recorded)', naming
    no module or line; Python's global functions are watched like numpy's now."""
    with pytest.raises(CaptureError) as info:
        capture(PythonNoise(), (torch.randn(4, 8),), annotate=False)
    assert "op random.random at module <model top level> (PythonNoise), source test_host_random.py:" in \
        str(info.value), str(info.value)
    assert random.random.__self__ is random._inst  # the watch puts Python's back
    capture(TorchNoise(), (torch.randn(4, 8),), annotate=False)  # the graph keeps the dropout op


def test_hf_wav2vec2_spec_augment_is_refused_and_trains_without_it() -> None:
    transformers = pytest.importorskip("transformers")
    from fairscale.testing.corpus_hf import Labels

    sizes = dict(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                 hidden_dropout=0.0, activation_dropout=0.0, attention_dropout=0.0, final_dropout=0.0, layerdrop=0.0,
                 conv_dim=[16, 16], conv_stride=[5, 2], conv_kernel=[10, 3], num_feat_extract_layers=2,
                 num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, classifier_proj_size=16)
    batch = (torch.randn(4, 400), torch.randint(0, 2, (4,)))
    torch.manual_seed(0)
    model = Labels(transformers.Wav2Vec2ForSequenceClassification(transformers.Wav2Vec2Config(**sizes)),
                   "input_values")
    assert model.inner.config.mask_time_prob > 0  # the default
    with pytest.raises(CaptureError) as info:
        capture(model, batch, annotate=False)
    assert "op numpy.random." in str(info.value) and "module inner.wav2vec2 (Wav2Vec2Model), source " \
           "modeling_wav2vec2.py:" in str(info.value), str(info.value)
    model.inner.config.mask_time_prob = 0.0
    capture(model, batch, annotate=False)


def test_library_code_is_not_skipped_where_site_packages_lies_in_the_standard_library_folder() -> None:
    """CI installs into the interpreter's own site-packages (``.../lib/python3.11/site-packages``),
    inside the folder of ``functools``: skipping that folder skipped transformers' frames, and the
    refusal named the test's line instead of ``modeling_wav2vec2.py``."""
    import functools
    import sysconfig

    from planner import host_random

    library = os.path.join(os.path.dirname(functools.__file__), "site-packages", "transformers", "modeling.py")
    assert not library.startswith(host_random._SKIP)
    assert not os.path.join(sysconfig.get_paths()["purelib"], "transformers", "x.py").startswith(host_random._SKIP)
    assert functools.__file__.startswith(host_random._SKIP)


class SeededBlocks(nn.Module):
    """Hugging Face BigBird's block-sparse attention in training: ``np.random.seed(self.seed)``
    (the layer's index), then ``np.random.permutation`` picks the random blocks, the same ones at
    every call."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 8)
        self.seed = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        np.random.seed(self.seed)
        keep = torch.from_numpy(np.random.permutation(8) < 6).to(x.dtype)
        return (self.net(x) * keep).pow(2).mean()


class SeededByStep(SeededBlocks):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seed += 1  # a step counter as the seed: other numbers at each call
        return super().forward(x)


def test_draws_after_a_seed_the_forward_sets_are_captured_and_a_seed_that_moves_is_refused() -> None:
    """HF BigBirdForMaskedLM (default config, block_sparse) was refused for every plan, 'op
    numpy.random.permutation at module ...attention.self (BigBirdBlockSparseAttention)', though its
    forward seeds numpy with a constant first, so the trace's constants are the blocks it draws at
    every call. Such draws are captured now; where the forward also sets a number on one of its
    modules (a seed that may move between calls), they are still refused."""
    x = torch.randn(4, 8)
    model = SeededBlocks()
    seed, module_setattr = np.random.seed, nn.Module.__dict__["__setattr__"]
    graph = capture(model, (x,), annotate=False)
    out = graph.gm(x)
    assert torch.allclose(out[0] if isinstance(out, (tuple, list)) else out, model(x))
    assert np.random.seed is seed and nn.Module.__dict__["__setattr__"] is module_setattr  # put back
    with pytest.raises(CaptureError) as info:
        capture(SeededByStep(), (x,), annotate=False)
    assert "op numpy.random.permutation at module <model top level> (SeededByStep)" in str(info.value), str(info.value)


def test_hf_bigbird_block_sparse_attention_is_captured() -> None:
    pytest.importorskip("transformers")
    from fairscale.testing.corpus import models

    case = models()["hf-bigbird"].build(0)
    assert case.model.inner.config.attention_type == "block_sparse"  # the default, used at this length
    capture(case.model, case.make_batch(0, 4), annotate=False)
