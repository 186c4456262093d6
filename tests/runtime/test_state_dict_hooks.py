"""pm.state_dict() honours the model's own state-dict hooks (issue 12, item 10): a fused QKV that
saves itself as q/k/v gives q/k/v keys, equal to model.state_dict() before training and to the
trained fused weight's parts after, and the model loads them back."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fairscale


class FusedAttention(nn.Module):
    """One fused projection, saved as three (what checkpoint-compatible LLM codebases do)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.dim = dim
        self.qkv = nn.Linear(dim, 3 * dim)
        self._register_state_dict_hook(self._split)
        self._register_load_state_dict_pre_hook(self._fuse)

    @staticmethod
    def _split(module: nn.Module, sd: dict, prefix: str, local_metadata: object) -> dict:  # type: ignore[type-arg]
        for kind in ("weight", "bias"):
            fused = sd.pop(f"{prefix}qkv.{kind}")
            for name, part in zip("qkv", fused.chunk(3)):
                sd[f"{prefix}{name}.{kind}"] = part
        return sd

    def _fuse(self, sd: dict, prefix: str, *args: object) -> None:  # type: ignore[type-arg]
        for kind in ("weight", "bias"):
            sd[f"{prefix}qkv.{kind}"] = torch.cat([sd.pop(f"{prefix}{n}.{kind}") for n in "qkv"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(self.dim, dim=-1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = FusedAttention()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x)).mean(1)


def _rank(rank: int, world: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Net()
    batch = (torch.randn(4, 6, 16), torch.randint(0, 4, (4,)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pm = fairscale.parallelize(model, example_inputs=batch, loss_fn=F.cross_entropy,
                               constraints={"mesh": {"dp": 2}})
    first = pm.state_dict()
    pm.train_step(batch)
    trained = pm.state_dict()
    return before, first, trained


def test_state_dict_runs_the_models_hooks() -> None:
    before, first, trained = fairscale.launch(_rank, devices=2)[0]
    assert sorted(first) == sorted(before) == sorted(["attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.q.bias",
                                                     "attn.k.bias", "attn.v.bias", "head.weight", "head.bias"])
    assert all(torch.equal(first[k], before[k]) for k in before)
    assert sorted(trained) == sorted(before) and not torch.equal(trained["attn.q.weight"], before["attn.q.weight"])
    fresh = Net()
    fresh.load_state_dict(trained)  # the model's own loader takes what pm saved
    assert torch.equal(fresh.attn.qkv.weight[:16], trained["attn.q.weight"])


class WithPositions(nn.Module):
    """A non-persistent buffer, as Hugging Face BERT registers ``position_ids``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("positions", torch.arange(6).float(), persistent=False)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.positions[:, None]).mean(1)


def _positions_rank(rank: int, world: int) -> tuple[list[str], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = WithPositions()
    batch = (torch.randn(4, 6, 16), torch.randint(0, 4, (4,)))
    pm = fairscale.parallelize(model, example_inputs=batch, loss_fn=F.cross_entropy,
                               constraints={"mesh": {"dp": 2}})
    pm.train_step(batch)
    pm.gather_into(model)  # the model's state_dict() refuses stale weights (runtime.model_guard)
    return sorted(model.state_dict()), pm.state_dict()


def test_state_dict_leaves_out_non_persistent_buffers_as_the_model_does() -> None:
    """Before: pm.state_dict() held them, and ``model.load_state_dict`` refused the result
    ("Unexpected key(s)": found on Hugging Face BERT with its default config)."""
    keys, trained = fairscale.launch(_positions_rank, devices=2)[0]
    assert sorted(trained) == keys == ["head.bias", "head.weight"]
    WithPositions().load_state_dict(trained)  # strict
