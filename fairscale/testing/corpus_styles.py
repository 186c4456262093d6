"""The corpus's own models: plain PyTorch and the styles of independent codebases.

Each entry builds a model written the way its codebase writes it (our own code; the classes live in
:mod:`fairscale.testing.corpus_styles_gpt`, :mod:`~fairscale.testing.corpus_styles_seq` and
:mod:`~fairscale.testing.corpus_styles_nets`), shrunk in size only, with dropout 0, and the loss the
way that codebase computes it. The registry is :mod:`fairscale.testing.corpus`.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fairscale.testing import corpus_styles_gen as gen
from fairscale.testing import corpus_styles_gpt as gpt
from fairscale.testing import corpus_styles_llama as llama
from fairscale.testing import corpus_styles_nets as nets
from fairscale.testing import corpus_styles_seq as seq
from fairscale.testing.corpus import CorpusModel
from fairscale.testing.models import Case

__all__ = ["MODELS"]

VOCAB, SEQ = 96, 16

Batch = Callable[[int, int], tuple[torch.Tensor, ...]]


def _images(classes: int, size: int = 16) -> Batch:
    def make(step: int, batch: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(7200 + step)
        return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, classes, (batch,), generator=g)

    return make


def _reconstruct(step: int, batch: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(7600 + step)
    x = torch.randn(batch, 3, 16, 16, generator=g)
    return x, x.clone()


def _masks(classes: int, size: int = 16) -> Batch:
    def make(step: int, batch: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(7300 + step)
        return (torch.randn(batch, 3, size, size, generator=g),
                torch.randint(0, classes, (batch, size, size), generator=g))

    return make


def _token_labels(classes: int) -> Batch:
    def make(step: int, batch: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(7400 + step)
        return torch.randint(0, VOCAB, (batch, SEQ), generator=g), torch.randint(0, classes, (batch,), generator=g)

    return make


def _features(classes: int, features: int = 12) -> Batch:
    def make(step: int, batch: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(7500 + step)
        return torch.randn(batch, SEQ, features, generator=g), torch.randint(0, classes, (batch,), generator=g)

    return make


# the losses, as each codebase writes them


def llama_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def flatten_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def per_token_then_mean(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x-transformers' class-dim-1 form, reduced by hand: per-token losses, then their mean."""
    loss = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")
    return loss.mean()


def _case(name: str, make: Callable[[], nn.Module], batch: Batch,
          loss_fn: Callable[..., torch.Tensor] | None) -> Callable[[int], Case]:
    def build(seed: int) -> Case:
        torch.manual_seed(seed)
        return Case(name, make(), batch, loss_fn)

    return build


def _entries() -> list[CorpusModel]:
    toks, ce = gpt.tokens(VOCAB, SEQ), F.cross_entropy
    pairs = seq.pairs(VOCAB, SEQ, SEQ)
    return [
        CorpusModel(name="nanogpt", build=_case("nanogpt", lambda: gpt.NanoGPT(gpt.NanoConfig()), toks, None),
                    origin="nanoGPT model.py style: GPT(GPTConfig), forward(idx, targets) -> (logits, loss)",
                    features="tied wte/lm_head, fused c_attn .split, SDPA is_causal, (logits, loss) tuple, "
                             "ignore_index=-1", default_tier=True),
        CorpusModel(name="mingpt", build=_case("mingpt", gpt.MinGPT, toks, None),
                    origin="minGPT model.py style",
                    features="registered causal-mask buffer, masked_fill(-inf) softmax, NewGELU with pow(x, 3), "
                             "MLP called through a lambda closure"),
        CorpusModel(name="meta-llama", build=_case("meta-llama", lambda: llama.MetaLlama(llama.LlamaArgs()), toks,
                                                   llama_loss),
                    origin="Meta llama model.py style (training form, no KV cache)",
                    features="RMSNorm x.pow(2) rsqrt, complex freqs_cis (view_as_complex), repeat_kv GQA, "
                             "SwiGLU, additive -inf triu mask"),
        CorpusModel(name="neox-fused-qkv", build=_case("neox-fused-qkv", gpt.NeoX, toks, llama_loss),
                    origin="GPT-NeoX / Megatron style",
                    features="fused per-head query_key_value with state-dict split/merge hooks, RMSNorm x * x "
                             "on row-parallel outputs, parallel residual", default_tier=True),
        CorpusModel(name="mistral-moe", build=_case("mistral-moe", seq.MistralMoE, toks, llama_loss),
                    origin="mistral-src moe.py style (Mixtral reference MoE)",
                    features="topk routing, torch.where(selected == i), results[idx] += ..., nn.RMSNorm, "
                             "nn.MultiheadAttention", default_tier=True),
        CorpusModel(name="switch-moe", build=_case("switch-moe", seq.SwitchMoE, _token_labels(8), ce),
                    origin="fairseq / Switch Transformer style top-1 MoE",
                    features="nonzero, index_select, index_add_, post-norm encoder"),
        CorpusModel(name="xtransformers", build=_case("xtransformers", seq.XTransformer, toks, flatten_loss),
                    origin="lucidrains / x-transformers style",
                    features="einsum attention, reshape+permute heads, GEGLU chunk, positional nn.Parameter, "
                             "loss cross_entropy(out.flatten(0, 1), y.flatten())"),
        CorpusModel(name="lm-none-mean", build=_case("lm-none-mean", seq.XTransformer, toks, per_token_then_mean),
                    origin="x-transformers style with a per-token loss reduced in loss_fn",
                    features="cross_entropy(logits.transpose(1, 2), y, reduction='none').mean()"),
        CorpusModel(name="t5-relpos", build=_case("t5-relpos", seq.RelPosT5, _token_labels(8), ce),
                    origin="T5 relative position bias, written from scratch",
                    features="bucketed relative positions (log, where, min), one bias table shared by layers, "
                             "unscaled attention, T5 RMSNorm"),
        CorpusModel(name="cls-encoder", build=_case("cls-encoder", seq.ClsEncoder, _token_labels(8), ce),
                    origin="BERT/ViT-style encoder classifier",
                    features="[CLS] nn.Parameter expanded and cat, learned positional nn.Parameter, tanh pooler, "
                             "nn.TransformerEncoder gelu batch_first"),
        CorpusModel(name="tied-seq2seq", build=_case("tied-seq2seq", seq.TiedSeq2Seq, pairs, None),
                    origin="weight-tied encoder-decoder (nn.TransformerEncoder/Decoder, norm_first)",
                    features="one embedding for source, target and lm_head, model computes its own loss"),
        CorpusModel(name="lstm-lm", build=_case("lstm-lm", seq.LSTMLM, toks, llama_loss),
                    origin="PyTorch word_language_model example style",
                    features="nn.LSTM, 2 layers, batch_first"),
        CorpusModel(name="torch-transformer", build=_case("torch-transformer", nets.TorchSeq2Seq, pairs, None),
                    origin="PyTorch translation tutorial style nn.Transformer",
                    features="nn.Transformer defaults (post-norm, sequence-first), sinusoidal buffer, t()"),
        CorpusModel(name="encoder-seqfirst", build=_case("encoder-seqfirst", nets.SeqFirstClassifier, _features(8), ce),
                    origin="nn.TransformerEncoder classifier, batch_first=False",
                    features="sequence-first activations (batch on dim 1), default post-norm, "
                             "nn.MultiheadAttention beside split MLPs", default_tier=True),
        CorpusModel(name="encoder-batchfirst",
                    build=_case("encoder-batchfirst", lambda: nets.SeqFirstClassifier(batch_first=True),
                                _features(8), ce),
                    origin="nn.TransformerEncoder classifier, batch_first=True",
                    features="default post-norm, mean pooling"),
        CorpusModel(name="vgg-bn", build=_case("vgg-bn", nets.VGGBN, _images(10), ce),
                    origin="torchvision VGG-with-BN style",
                    features="BatchNorm2d, nn.ReLU(inplace=True), MaxPool, AdaptiveAvgPool, flatten"),
        CorpusModel(name="resnet", build=_case("resnet", nets.ResNetMini, _images(10), ce),
                    origin="torchvision ResNet style (BasicBlock + Bottleneck)",
                    features="BatchNorm2d, in-place ReLU, out += identity, downsample branch", default_tier=True),
        CorpusModel(name="mlp-mixer", build=_case("mlp-mixer", nets.MLPMixer, _images(10), ce),
                    origin="MLP-Mixer style",
                    features="patch conv stem, token-mixing MLP over transposed patches"),
        CorpusModel(name="convnext", build=_case("convnext", nets.ConvNeXtMini, _images(10), ce),
                    origin="ConvNeXt style",
                    features="depthwise 7x7 conv, permute + LayerNorm channels-last, layer scale gamma, "
                             "hand-written channels-first LayerNorm"),
        CorpusModel(name="unet", build=_case("unet", nets.UNetMini, _masks(4), ce),
                    origin="U-Net (milesial Pytorch-UNet style)",
                    features="torch.cat skips, ConvTranspose2d, GroupNorm, in-place ReLU, per-pixel loss"),
        CorpusModel(name="vqvae-ema", build=_case("vqvae-ema", gen.VQVAEEMA, _reconstruct, gen.vq_loss),
                    origin="VQ-VAE with an EMA codebook (VQ-VAE-2 implementations)",
                    features="argmin codebook lookup, one_hot, straight-through z + (zq - z).detach(), buffers "
                             "written in place under torch.no_grad() in forward"),
        CorpusModel(name="vqvae-zalando", build=_case("vqvae-zalando", gen.ZalandoVQVAE, _reconstruct, gen.vq_loss),
                    origin="zalandoresearch/pytorch-vq-vae VectorQuantizerEMA",
                    features="a buffer and new nn.Parameters bound in forward (refused at capture)"),
        CorpusModel(name="fsq-ste", build=_case("fsq-ste", gen.STEQuantizer, _reconstruct, gen.vq_loss),
                    origin="finite scalar quantization with a straight-through autograd.Function",
                    features="custom autograd.Function whose backward is not its forward's gradient (refused at "
                             "capture)"),
    ]


MODELS: dict[str, CorpusModel] = {m.name: m for m in _entries()}
