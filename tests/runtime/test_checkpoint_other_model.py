"""``pm.load_checkpoint`` of a checkpoint that is not of this model or optimizer is refused before
anything is loaded, as torch's strict ``load_state_dict`` and ``Optimizer.load_state_dict`` refuse it.

It had resumed a 2-layer model from a 4-layer model's checkpoint without a word (the keys no rank
holds were never read), failed on a wider model inside a copy naming no key ('The size of tensor a
(48) must match the size of tensor b (32)'), and paired a two-group optimizer's options with a
one-group optimizer's, so every parameter resumed with the first group's weight decay.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from planner.plan import Mesh, Plan


class _Net(nn.Module):
    def __init__(self, layers: int = 2, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return F.mse_loss(self.norm(x).sum(-1), y)


def _groups(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    rest = [p for n, p in model.named_parameters() if "norm" in n]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)


def _batch(width: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, width, generator=g), torch.randn(4, generator=g)


def _load(path: str, model: nn.Module, optimizer, width: int = 8) -> str:
    """``optimizer(model)``: what parallelize is given."""
    pm = fairscale.parallelize(model, example_inputs=_batch(width), plan=Plan(mesh=Mesh(dp=2)), optimizer=optimizer(model))
    try:
        pm.load_checkpoint(path)
        return "loaded"
    except ValueError as exc:
        return str(exc)
    finally:
        pm.close()


def _rank(rank: int, world: int, path: str) -> dict[str, str]:
    torch.manual_seed(0)
    model = _Net(layers=3)
    pm = fairscale.parallelize(model, example_inputs=_batch(), plan=Plan(mesh=Mesh(dp=2)), optimizer=_groups(model))
    pm.train_step(_batch())
    pm.save_checkpoint(path)
    pm.close()
    return {"same": _load(path, _Net(layers=3), _groups),
            "fewer layers": _load(path, _Net(layers=2), _groups),
            "wider": _load(path, _Net(layers=3, width=12), _groups, width=12),
            "one group": _load(path, _Net(layers=3), lambda _: functools.partial(torch.optim.AdamW, lr=1e-2))}


def test_a_checkpoint_of_another_model_or_optimizer_is_refused(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    for got in fairscale.launch(_rank, devices=2, args=(path,)):
        assert got["same"] == "loaded"
        head = f"pm.load_checkpoint({path!r}): the checkpoint is not of this model (_Net): it holds "
        assert got["fewer layers"].startswith(head + "2 tensor(s) this model has none of, e.g. layers.2.bias, "
                                                     "layers.2.weight; load it into the model it was saved from"), got
        assert got["wider"].startswith(head + "8 tensor(s) of another shape: layers.0.bias is [8] there and [12] "
                                              "here; layers.0.weight is [8, 8] there and [12, 12] here;"), got
        assert got["one group"] == (f"pm.load_checkpoint({path!r}): the checkpoint's optimizer has 2 parameter "
                                    "group(s) and pm.optimizer has 1: build the optimizer given to "
                                    "fairscale.parallelize with the groups of the run that saved it (the same "
                                    "parameters in each, in the same order)"), got
