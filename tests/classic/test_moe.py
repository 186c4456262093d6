"""MOELayer with experts spread over gloo ranks trains exactly like one process holding every expert."""

from __future__ import annotations

import io

import pytest
import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it lazily: once here, not in every forked rank)
import torch.distributed as dist
from torch import nn

import fairscale
from fairscale.nn.moe import MOELayer, Top2Gate
from fairscale.nn.moe.top2gate import top2gating

M, LOCAL, STEPS = 8, 2, 3


def _pack(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> object:
    return torch.load(io.BytesIO(data), weights_only=False)


def _build(world: int) -> tuple[Top2Gate, list[nn.Module]]:
    torch.manual_seed(0)
    gate = Top2Gate(M, world * LOCAL, second_expert_noise=False)
    experts = [nn.Sequential(nn.Linear(M, 16), nn.ReLU(), nn.Linear(16, M)) for _ in range(world * LOCAL)]
    return gate, experts


def _tokens(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 5, M, generator=torch.Generator().manual_seed(10 * step + rank))


def _loss(layer: MOELayer, x: torch.Tensor) -> torch.Tensor:
    return (layer(x) - x.flip(-1)).pow(2).mean() + 0.01 * layer.l_aux


def _run(rank: int, world: int) -> bytes:
    gate, experts = _build(world)
    layer = MOELayer(gate, nn.ModuleList(experts[rank * LOCAL:(rank + 1) * LOCAL]))
    opt = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = _loss(layer, _tokens(step, rank))
        loss.backward()
        for p in layer.gate.parameters():  # the replicated gate: data parallel
            dist.all_reduce(p.grad)
        for p in layer.parameters():  # global loss = mean of the ranks' losses
            p.grad.div_(world)
        opt.step()
        g = loss.detach().clone()
        dist.all_reduce(g)
        losses.append(g.item() / world)
    return _pack({"losses": losses, "gate": layer.gate.wg.weight.detach().clone(),
                  "experts": [e.state_dict() for e in layer.experts]})


def _reference(world: int) -> dict:
    gate, experts = _build(world)
    layer = MOELayer(gate, nn.ModuleList(experts))  # no process group: every expert local
    opt = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        # each rank's tokens routed on their own (capacity depends on the local token count)
        loss = sum(_loss(layer, _tokens(step, r)) for r in range(world)) / world
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "gate": layer.gate.wg.weight.detach().clone(),
            "experts": [e.state_dict() for e in layer.experts]}


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_all_local(world: int) -> None:
    results = [_unpack(r) for r in fairscale.launch(_run, devices=world)]
    ref = _reference(world)
    for rank, r in enumerate(results):
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        torch.testing.assert_close(r["gate"], ref["gate"], rtol=1e-5, atol=1e-5)
        for i, sd in enumerate(r["experts"]):
            for k, v in ref["experts"][rank * LOCAL + i].items():
                torch.testing.assert_close(sd[k], v, rtol=1e-5, atol=1e-5)
    assert ref["losses"][-1] < ref["losses"][0]


def test_top2gating_by_hand() -> None:
    # 4 tokens, 2 experts: capacity 2·⌈4/2⌉ = 4, so nothing is dropped
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0], [1.0, 1.5]])
    l_aux, combine, dispatch = top2gating(logits, second_expert_noise=False)
    gates = logits.softmax(-1)
    # first choices: experts 0, 1, 0, 1 -> ce = [.5, .5]; me = mean gates; FairScale 0.4.13's
    # l_aux = mean_e(me·ce) = Σ_e me·ce / E (GShard's E·Σ me·ce is E² times larger)
    assert l_aux.item() == pytest.approx((gates.mean(0) * torch.tensor([0.5, 0.5])).sum().item() / 2)
    assert combine.shape == (4, 2, 4)
    torch.testing.assert_close(combine.sum(dim=(1, 2)), torch.ones(4))  # g1 + g2 = 1 per token
    # token 0 goes first to expert 0 slot 0; token 2 to expert 0 slot 1; seconds queue after firsts
    assert combine[0, 0, 0] == pytest.approx(gates[0, 0].item())
    assert combine[2, 0, 1] == pytest.approx(gates[2, 0].item())
    assert combine[0, 1, 2] == pytest.approx(gates[0, 1].item())  # 2 firsts at expert 1, then token 0
    assert torch.equal(dispatch, combine > 0)


def test_capacity_drops_overflow_tokens() -> None:
    logits = torch.tensor([[5.0, 0.0, -5.0]] * 6)  # all prefer expert 0; capacity 2·⌈6/3⌉ = 4
    _, combine, dispatch = top2gating(logits, second_expert_noise=False)
    assert dispatch[:, 0].sum() == 4  # two tokens dropped at expert 0
    assert dispatch[:, 1].sum() == 4  # and expert 1 takes 4 of the 6 second choices


def test_gate_size_mismatch_is_explained() -> None:
    layer = MOELayer(Top2Gate(M, 3), nn.ModuleList([nn.Linear(M, M)]))
    with pytest.raises(ValueError, match=r"routes to 3 experts, but world_size\(1\) × local experts\(1\) = 1"):
        layer(torch.randn(4, M))


def test_aux_loss_and_noisy_second_choice_follow_fairscale() -> None:
    """FairScale 0.4.13's Top2Gate, computed independently: l_aux = mean_e(me·ce) (1/E² when routing
    is uniform), and the second expert is argmax of the logits plus Gumbel(0, 1) noise drawn from
    torch.distributions, in training and in eval mode alike (so one seed routes the same)."""
    experts = 6
    logits = torch.eye(experts).repeat(2, 1) * 4.0  # 12 tokens, each expert first for 2 of them
    l_aux, _, _ = top2gating(logits, second_expert_noise=False)
    gates = logits.softmax(-1)
    assert l_aux.item() == pytest.approx((gates.mean(0) * (1 / experts)).mean().item())
    assert l_aux.item() == pytest.approx(1 / experts**2, rel=1e-6)  # uniform: me = ce = 1/E

    torch.manual_seed(3)
    gate = Top2Gate(4, experts)
    x = torch.randn(12, 4)
    for mode in (gate.train, gate.eval):
        mode()
        torch.manual_seed(7)
        _, combine, _ = gate(x)
        torch.manual_seed(7)
        logits = gate.wg(x)
        noise = torch.distributions.Gumbel(torch.tensor(0.0), torch.tensor(1.0)).rsample(logits.shape)
        first = logits.argmax(1)
        second = (logits + noise).scatter(1, first[:, None], float("-inf")).argmax(1)
        routed = combine.sum(2) > 0  # (tokens, experts): where each token went
        for t in range(12):
            kept = set(routed[t].nonzero().flatten().tolist())
            assert kept <= {first[t].item(), second[t].item()}
            assert first[t].item() in kept  # capacity 4 per expert: firsts are never dropped here
