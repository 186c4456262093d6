"""Small, deterministic model families for tests, benchmarks and the demo.

Each ``build_*`` returns a :class:`Case`: a freshly initialized model (seeded), a function that
makes batch ``i`` for a global batch size, and the loss convention ``planner.capture`` expects
(``loss_fn=None``: the model returns its loss; otherwise ``loss_fn(model(batch[0]), *batch[1:])``).
Hugging Face families are built from tiny random-init configs; nothing is downloaded. Dropout is
off everywhere so that parallel runs can match single-process runs exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Case", "GPT", "GPTConfig", "build", "FAMILIES", "lm_loss"]


@dataclass
class Case:
    name: str
    model: nn.Module
    make_batch: Callable[[int, int], tuple[torch.Tensor, ...]]
    """(step, global_batch) -> batch tuple; deterministic in step."""
    loss_fn: Callable[..., torch.Tensor] | None


def lm_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    """Next-token-free LM loss: cross-entropy of logits against labels, mean over tokens."""
    logits = out if isinstance(out, torch.Tensor) else out.logits
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # the loss of half-precision logits is taken in fp32
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


# ---------------------------------------------------------------------------------------------
# nanoGPT-style GPT (our own code), with tied embeddings


@dataclass
class GPTConfig:
    vocab: int = 256
    seq: int = 32
    layers: int = 4
    heads: int = 4
    dim: int = 64
    tied: bool = True


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.q_proj = nn.Linear(cfg.dim, cfg.dim)
        # No key bias: it adds q·b to every score of a query, which softmax ignores, so its true
        # gradient is 0 and Adam would turn float noise in it into lr-sized steps.
        self.k_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.dim)
        self.o_proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, h, d // h).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.down_proj = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A nanoGPT-shaped decoder: token + position embeddings, pre-LN blocks, tied LM head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.dim)
        self.wpe = nn.Embedding(cfg.seq, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tied:
            self.lm_head.weight = self.wte.weight
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)
        for name, p in self.named_parameters():
            if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _tokens(vocab: int, seq: int) -> Callable[[int, int], tuple[torch.Tensor, ...]]:
    def make(step: int, batch: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    return make


def build_gpt(seed: int = 0, **overrides: Any) -> Case:
    cfg = GPTConfig(**overrides)
    torch.manual_seed(seed)
    return Case("gpt", GPT(cfg), _tokens(cfg.vocab, cfg.seq), lm_loss)


# ---------------------------------------------------------------------------------------------
# plain PyTorch families


class MLPNet(nn.Module):
    def __init__(self, dims: tuple[int, ...] = (32, 64, 64, 64, 10)) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[
            nn.Sequential(nn.Linear(a, b), nn.ReLU()) if i < len(dims) - 2 else nn.Linear(a, b)
            for i, (a, b) in enumerate(zip(dims, dims[1:]))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _classify(shape: tuple[int, ...], classes: int) -> Callable[[int, int], tuple[torch.Tensor, ...]]:
    def make(step: int, batch: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(2000 + step)
        return torch.randn((batch, *shape), generator=g), torch.randint(0, classes, (batch,), generator=g)

    return make


def build_mlp(seed: int = 0) -> Case:
    torch.manual_seed(seed)
    return Case("mlp", MLPNet(), _classify((32,), 10), F.cross_entropy)


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
            nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)))
        self.head = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def build_cnn(seed: int = 0) -> Case:
    torch.manual_seed(seed)
    return Case("cnn", CNN(), _classify((3, 16, 16), 10), F.cross_entropy)


class EncoderClassifier(nn.Module):
    def __init__(self, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(8, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(1))


def build_encoder(seed: int = 0) -> Case:
    torch.manual_seed(seed)
    return Case("encoder", EncoderClassifier(), _classify((12, 8), 10), F.cross_entropy)


class SkipNet(nn.Module):
    """A mask computed once from the input and used by every block, and a skip connection from the
    embedding to the head across every block (what a pipeline must relay between stages)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (x.abs().sum(-1, keepdim=True) > 6.0).to(x.dtype)
        h0 = self.embed(x)
        h = h0
        for block in self.blocks:
            h = torch.tanh(block(h)) * mask + h
        return self.head(h + h0)


def build_skip(seed: int = 0) -> Case:
    torch.manual_seed(seed)
    return Case("skip", SkipNet(), _classify((8,), 10), F.cross_entropy)


# ---------------------------------------------------------------------------------------------
# Hugging Face families (tiny random-init configs; transformers is a test extra)

_HF_COMMON: dict[str, Any] = {}
"""Settings every family below shares beyond its own: none. ``use_cache=False`` stood here from the
first day, hiding what a default config does (its key/value cache); removed 2026-11-28 with every
test that builds these families passing (the corpus builds default configs of its own)."""


def build_llama(seed: int = 0, *, layers: int = 2, heads: int = 4, kv_heads: int = 2, dim: int = 64,
                vocab: int = 128, seq: int = 16) -> Case:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq,
                      attention_dropout=0.0, **_HF_COMMON)
    torch.manual_seed(seed)
    return Case("llama", LlamaForCausalLM(cfg), _tokens(vocab, seq), lm_loss)


def build_gpt2(seed: int = 0, *, layers: int = 2, heads: int = 4, dim: int = 64, vocab: int = 128,
               seq: int = 16) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=dim, n_layer=layers, n_head=heads,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                     **_HF_COMMON)
    torch.manual_seed(seed)
    return Case("gpt2", GPT2LMHeadModel(cfg), _tokens(vocab, seq), lm_loss)


def build_bert(seed: int = 0, *, layers: int = 2, heads: int = 4, dim: int = 64, vocab: int = 128,
               seq: int = 16) -> Case:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=vocab, hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=2 * dim, max_position_embeddings=seq, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    return Case("bert", BertForMaskedLM(cfg), _tokens(vocab, seq), lm_loss)


def build_t5(seed: int = 0, *, layers: int = 2, heads: int = 4, dim: int = 64, vocab: int = 128,
             seq: int = 16) -> Case:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=vocab, d_model=dim, d_kv=dim // heads, d_ff=2 * dim, num_layers=layers,
                   num_heads=heads, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                   **_HF_COMMON)
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(cfg)
    make = _tokens(vocab, seq)

    def batch(step: int, n: int) -> tuple[torch.Tensor, ...]:
        ids, labels = make(step, n)
        return ids, labels

    class T5Loss(nn.Module):
        """T5 takes (input_ids, labels) and returns its own loss."""

        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.inner(input_ids=ids, labels=labels).loss

    return Case("t5", T5Loss(model), batch, None)


def build_mixtral(seed: int = 0, *, layers: int = 2, heads: int = 4, kv_heads: int = 2, dim: int = 64,
                  vocab: int = 128, seq: int = 16, experts: int = 4) -> Case:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, num_local_experts=experts,
                        num_experts_per_tok=2, max_position_embeddings=seq, router_aux_loss_coef=0.0,
                        **_HF_COMMON)
    torch.manual_seed(seed)
    return Case("mixtral", MixtralForCausalLM(cfg), _tokens(vocab, seq), lm_loss)


def build_vit(seed: int = 0, *, layers: int = 2, heads: int = 4, dim: int = 64) -> Case:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=dim, num_hidden_layers=layers,
                    num_attention_heads=heads, intermediate_size=2 * dim, num_labels=10,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    return Case("vit", ViTForImageClassification(cfg), _classify((3, 16, 16), 10), lm_loss)


FAMILIES: dict[str, Callable[..., Case]] = {
    "gpt": build_gpt, "mlp": build_mlp, "cnn": build_cnn, "encoder": build_encoder, "skip": build_skip,
    "llama": build_llama,
    "gpt2": build_gpt2, "bert": build_bert, "t5": build_t5, "mixtral": build_mixtral, "vit": build_vit,
}


def build(name: str, seed: int = 0, **overrides: Any) -> Case:
    """Build the named family: gpt, mlp, cnn, encoder, skip, llama, gpt2, bert, t5, mixtral, vit."""
    try:
        factory = FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; choose from {sorted(FAMILIES)}") from None
    return factory(seed, **overrides)
