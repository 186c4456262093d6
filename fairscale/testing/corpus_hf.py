"""The Hugging Face half of the conformance corpus: ``transformers`` models with DEFAULT configs.

Each model is built from its default config class with sizes shrunk only: layers, hidden width,
heads (and key/value heads, head dims, rotary dims), feed-forward width, experts (and experts per
token), vocabulary, positions, mel bins and image size. Dropout probabilities are 0 (a parallel
run can match one process only without random masks). Everything else is the library's default
as a user gets it: ``use_cache=True``, tied embeddings, attention implementation, norms,
activations, initializers and the loss each model computes from ``labels``.

Special token ids (pad, bos, eos, decoder start) are positions in the vocabulary, so shrinking
the vocabulary moves them into it: an id the default config sets beyond the shrunk vocabulary is
remapped to the last ids (:func:`_ids`); one the model cannot run without and the default config
leaves unset (T5's decoder start) gets the value of the published checkpoints (0, the pad id).

Every model is called as ``Labels(model)(inputs, labels)``: the wrapper only passes the two batch
tensors by keyword (``input_ids=`` / ``input_features=`` / ``pixel_values=``, ``labels=``) and
returns the model's output, whose ``.loss`` the capture reads. The batches are deterministic in
the step: token ids, and for masked LMs labels at a quarter of the positions (``-100``
elsewhere, as a masked-LM collator makes them, so the per-step token count varies by row).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from fairscale.testing.corpus import CorpusModel
from fairscale.testing.models import Case

__all__ = ["MODELS", "Labels", "VOCAB", "SEQ", "DIM"]

VOCAB, SEQ, DIM, LAYERS, HEADS, KV_HEADS = 128, 16, 64, 2, 4, 2
HEAD_DIM = DIM // HEADS
IGNORE = -100
"""The label Hugging Face's losses ignore."""


class Labels(nn.Module):
    """``inner(**{input_key: x, "labels": labels})``: the batch is ``(x, labels)``."""

    def __init__(self, inner: nn.Module, input_key: str = "input_ids") -> None:
        super().__init__()
        self.inner = inner
        self.input_key = input_key

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Any:
        return self.inner(**{self.input_key: x, "labels": labels})


def _tokens(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal LM and seq2seq batches: ids and labels of the same tokens (the model shifts them)."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return ids, ids.clone()


def _masked(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked LM batches: labels at about a quarter of the positions, ``-100`` elsewhere."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    chosen = torch.rand((n, SEQ), generator=g) < 0.25
    return ids, torch.where(chosen, ids, torch.full_like(ids, IGNORE))


def _audio(mel_bins: int, frames: int) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
    def make(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(3000 + step)
        return torch.randn((n, mel_bins, frames), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return make


def _images(size: int, classes: int) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
    def make(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(2000 + step)
        return torch.randn((n, 3, size, size), generator=g), torch.randint(0, classes, (n,), generator=g)
    return make


def _ids(config_cls: type, **names: int) -> dict[str, int]:
    """Special token ids of ``config_cls``'s defaults that fall outside the shrunk vocabulary,
    remapped to the last ids (in the given order of preference), and nothing else."""
    defaults = config_cls()
    out = {}
    for name, fallback in names.items():
        value = getattr(defaults, name, None)
        if isinstance(value, int) and value >= VOCAB:
            out[name] = fallback
    return out


def _entry(name: str, origin: str, make: Callable[[], nn.Module], batch: Callable[[int, int], tuple[torch.Tensor, ...]],
           *, input_key: str = "input_ids", features: str = "", default_tier: bool = False) -> CorpusModel:
    def build(seed: int) -> Case:
        torch.manual_seed(seed)
        return Case(name, Labels(make(), input_key), batch, None)
    return CorpusModel(name=name, build=build, origin=origin, features=features, default_tier=default_tier)


def _decoder(config: str, model: str, **sizes: Any) -> Callable[[], nn.Module]:
    """A Llama-shaped decoder (hidden/intermediate/layers/heads/kv heads/positions) plus ``sizes``."""
    def make() -> nn.Module:
        import transformers

        cls = getattr(transformers, config)
        cfg = cls(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, max_position_embeddings=SEQ, **sizes,
                  **_ids(cls, pad_token_id=VOCAB - 1, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 3))
        return getattr(transformers, model)(cfg)
    return make


def _make(config: str, model: str, **sizes: Any) -> Callable[[], nn.Module]:
    """Any other model: its config with exactly ``sizes`` (and remapped special ids)."""
    def make() -> nn.Module:
        import transformers

        cls = getattr(transformers, config)
        ids = _ids(cls, pad_token_id=VOCAB - 1, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 3,
                   decoder_start_token_id=VOCAB - 2)
        return getattr(transformers, model)(cls(**sizes, **ids))
    return make


_KV = dict(num_key_value_heads=KV_HEADS)
_CAUSAL = "causal LM (ForCausalLMLoss: mean over the shifted tokens)"

MODELS: dict[str, CorpusModel] = {m.name: m for m in [
    _entry("hf-llama", "transformers LlamaForCausalLM, default LlamaConfig",
           _decoder("LlamaConfig", "LlamaForCausalLM", head_dim=HEAD_DIM, **_KV), _tokens,
           features=f"RMSNorm, rotary, GQA, KV cache on, untied head; {_CAUSAL}", default_tier=True),
    _entry("hf-mistral", "transformers MistralForCausalLM, default MistralConfig",
           _decoder("MistralConfig", "MistralForCausalLM", head_dim=HEAD_DIM, **_KV), _tokens,
           features="sliding-window config, GQA"),
    _entry("hf-qwen2", "transformers Qwen2ForCausalLM, default Qwen2Config",
           _decoder("Qwen2Config", "Qwen2ForCausalLM", **_KV), _tokens, features="q/k/v biases, GQA"),
    _entry("hf-qwen3", "transformers Qwen3ForCausalLM, default Qwen3Config",
           _decoder("Qwen3Config", "Qwen3ForCausalLM", head_dim=HEAD_DIM, **_KV), _tokens,
           features="q/k RMSNorm per head"),
    _entry("hf-qwen3-moe", "transformers Qwen3MoeForCausalLM, default Qwen3MoeConfig",
           _decoder("Qwen3MoeConfig", "Qwen3MoeForCausalLM", head_dim=HEAD_DIM, moe_intermediate_size=DIM,
                    num_local_experts=4, num_experts_per_tok=2, **_KV), _tokens,
           features="mixture of experts (top-2 of 4), q/k norms"),
    _entry("hf-mixtral", "transformers MixtralForCausalLM, default MixtralConfig",
           _decoder("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, **_KV), _tokens,
           features="mixture of experts (top-2 of 4), grouped expert matmul"),
    _entry("hf-gemma", "transformers GemmaForCausalLM, default GemmaConfig",
           _decoder("GemmaConfig", "GemmaForCausalLM", head_dim=HEAD_DIM, **_KV), _tokens,
           features="tied head, embedding scaled by sqrt(hidden), (1 + w) RMSNorm, gelu-tanh GLU"),
    _entry("hf-phi3", "transformers Phi3ForCausalLM, default Phi3Config",
           _decoder("Phi3Config", "Phi3ForCausalLM", resid_pdrop=0.0, embd_pdrop=0.0, **_KV), _tokens,
           features="fused qkv_proj and gate_up_proj (chunked)"),
    _entry("hf-opt", "transformers OPTForCausalLM, default OPTConfig",
           _make("OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=DIM, word_embed_proj_dim=DIM,
                 ffn_dim=2 * DIM, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                 max_position_embeddings=SEQ, dropout=0.0), _tokens,
           features="learned positions with offset 2, ReLU, tied head"),
    _entry("hf-gptj", "transformers GPTJForCausalLM, default GPTJConfig",
           _make("GPTJConfig", "GPTJForCausalLM", vocab_size=VOCAB, n_positions=SEQ, n_embd=DIM, n_layer=LAYERS,
                 n_head=HEADS, rotary_dim=HEAD_DIM // 2), _tokens,
           features="parallel attention + MLP, partial rotary, untied head with bias"),
    _entry("hf-gpt2", "transformers GPT2LMHeadModel, default GPT2Config",
           _make("GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_positions=SEQ, n_embd=DIM, n_layer=LAYERS,
                 n_head=HEADS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), _tokens,
           features="HF Conv1D (transposed weights), fused c_attn, tied head"),
    _entry("hf-gpt-neox", "transformers GPTNeoXForCausalLM, default GPTNeoXConfig",
           _make("GPTNeoXConfig", "GPTNeoXForCausalLM", vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM,
                 num_hidden_layers=LAYERS, num_attention_heads=HEADS, max_position_embeddings=SEQ), _tokens,
           features="fused query_key_value, parallel residual, partial rotary"),
    _entry("hf-falcon", "transformers FalconForCausalLM, default FalconConfig",
           _make("FalconConfig", "FalconForCausalLM", vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, num_kv_heads=HEADS, max_position_embeddings=SEQ,
                 ffn_hidden_size=4 * DIM), _tokens,
           features="multi-query attention, parallel attention, tied head"),
    _entry("hf-bert", "transformers BertForMaskedLM, default BertConfig",
           _make("BertConfig", "BertForMaskedLM", vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, intermediate_size=2 * DIM, max_position_embeddings=SEQ,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), _masked,
           features="post-LN encoder, tied MLM head with transform, -100 labels (token count varies by row)"),
    _entry("hf-albert", "transformers AlbertForMaskedLM, default AlbertConfig",
           _make("AlbertConfig", "AlbertForMaskedLM", vocab_size=VOCAB, embedding_size=DIM // 2, hidden_size=DIM,
                 num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=2 * DIM,
                 max_position_embeddings=SEQ), _masked,
           features="one layer's weights shared across depth (no repeated block), factorized embedding, -100 labels"),
    _entry("hf-roberta", "transformers RobertaForMaskedLM, default RobertaConfig",
           _make("RobertaConfig", "RobertaForMaskedLM", vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, intermediate_size=2 * DIM, max_position_embeddings=SEQ + 2,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), _masked,
           features="positions from the padding mask (cumsum), -100 labels"),
    _entry("hf-bigbird", "transformers BigBirdForMaskedLM, default BigBirdConfig",
           _make("BigBirdConfig", "BigBirdForMaskedLM", vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, intermediate_size=2 * DIM, max_position_embeddings=SEQ, block_size=2,
                 num_random_blocks=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), _masked,
           features="block-sparse attention whose random blocks numpy draws after seeding it with the layer's "
                    "index (the same blocks at every call), -100 labels"),
    _entry("hf-distilbert", "transformers DistilBertForMaskedLM, default DistilBertConfig",
           _make("DistilBertConfig", "DistilBertForMaskedLM", vocab_size=VOCAB, max_position_embeddings=SEQ,
                 n_layers=LAYERS, n_heads=HEADS, dim=DIM, hidden_dim=2 * DIM, dropout=0.0, attention_dropout=0.0),
           _masked, features="no token types, -100 labels"),
    _entry("hf-t5", "transformers T5ForConditionalGeneration, default T5Config",
           _make("T5Config", "T5ForConditionalGeneration", vocab_size=VOCAB, d_model=DIM, d_kv=HEAD_DIM,
                 d_ff=2 * DIM, num_layers=LAYERS, num_heads=HEADS, dropout_rate=0.0, decoder_start_token_id=0),
           _tokens, features="encoder-decoder, one embedding shared by encoder, decoder and LM head, "
                             "relative position bias", default_tier=True),
    _entry("hf-bart", "transformers BartForConditionalGeneration, default BartConfig",
           _make("BartConfig", "BartForConditionalGeneration", vocab_size=VOCAB, d_model=DIM,
                 max_position_embeddings=SEQ, encoder_layers=LAYERS, decoder_layers=LAYERS,
                 encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=2 * DIM,
                 decoder_ffn_dim=2 * DIM, dropout=0.0), _tokens,
           features="encoder-decoder, shared embedding tied to the head, final_logits_bias buffer"),
    _entry("hf-whisper", "transformers WhisperForConditionalGeneration, default WhisperConfig",
           _make("WhisperConfig", "WhisperForConditionalGeneration", vocab_size=VOCAB, num_mel_bins=8, d_model=DIM,
                 encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
                 decoder_attention_heads=HEADS, encoder_ffn_dim=2 * DIM, decoder_ffn_dim=2 * DIM,
                 max_source_positions=SEQ, max_target_positions=SEQ),
           _audio(8, 2 * SEQ), input_key="input_features",
           features="conv front end on mel features, sinusoidal encoder positions, tied decoder head"),
    _entry("hf-vit", "transformers ViTForImageClassification, default ViTConfig",
           _make("ViTConfig", "ViTForImageClassification", hidden_size=DIM, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, intermediate_size=2 * DIM, image_size=16, patch_size=4),
           _images(16, 2), input_key="pixel_values", features="patch conv, CLS token, image classification"),
]}
