"""Hugging Face models with their library's DEFAULT configuration values, shrunk in size only.

Only sizes (layers, widths, heads, vocabulary, positions) and dropout probabilities are set:
dropout is set to 0 because a parallel run can match a single-process run only without random
masks. Everything else (``use_cache=True``, tied embeddings, attention implementation, norms,
activations, loss functions) is the library's default, as a user gets it. Each builder returns
``(model, make_batch)``; the model computes its own loss from ``labels`` (Hugging Face's
``ForCausalLMLoss`` / ``ForMaskedLMLoss`` / T5's ``CrossEntropyLoss``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

__all__ = ["BUILDERS", "build_hf"]

VOCAB, SEQ, DIM, LAYERS, HEADS = 128, 16, 64, 2, 4


class WithLabels(nn.Module):
    """``model(input_ids=ids, labels=labels).loss``: the batch is (ids, labels)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=ids, labels=labels).loss


def _tokens(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def _llama_like(config_cls: str, model_cls: str, **extra: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import transformers

        cfg = getattr(transformers, config_cls)(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM,
                                                num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                                num_key_value_heads=2, max_position_embeddings=SEQ, **extra)
        return WithLabels(getattr(transformers, model_cls)(cfg))
    return make


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=DIM, n_layer=LAYERS, n_head=HEADS,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return WithLabels(GPT2LMHeadModel(cfg))


def _neox() -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=LAYERS,
                        num_attention_heads=HEADS, max_position_embeddings=SEQ)
    return WithLabels(GPTNeoXForCausalLM(cfg))


def _falcon() -> nn.Module:
    from transformers import FalconConfig, FalconForCausalLM

    cfg = FalconConfig(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                       hidden_dropout=0.0, attention_dropout=0.0)
    return WithLabels(FalconForCausalLM(cfg))


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                     intermediate_size=2 * DIM, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return WithLabels(BertForMaskedLM(cfg))


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=DIM, d_kv=DIM // HEADS, d_ff=2 * DIM, num_layers=LAYERS,
                   num_heads=HEADS, dropout_rate=0.0, decoder_start_token_id=0)
    return WithLabels(T5ForConditionalGeneration(cfg))


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "llama": _llama_like("LlamaConfig", "LlamaForCausalLM", attention_dropout=0.0),
    "mistral": _llama_like("MistralConfig", "MistralForCausalLM", attention_dropout=0.0),
    "qwen2": _llama_like("Qwen2Config", "Qwen2ForCausalLM", attention_dropout=0.0),
    "mixtral": _llama_like("MixtralConfig", "MixtralForCausalLM", attention_dropout=0.0, num_local_experts=4),
    "gpt2": _gpt2, "gpt_neox": _neox, "falcon": _falcon, "bert": _bert, "t5": _t5,
}


def build_hf(name: str, seed: int = 0) -> tuple[nn.Module, Callable[[int, int], tuple[torch.Tensor, ...]]]:
    torch.manual_seed(seed)
    return BUILDERS[name](), _tokens
