"""Single-process Pipe (GPipe): equals the Sequential, skip connections, balance helpers, errors;
and data-parallel ranks each running a Pipe train exactly like one process."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it lazily: once here, not in every forked rank)
import torch.distributed as dist
from torch import nn

import fairscale
from fairscale.nn.pipe import BalanceError, Pipe
from fairscale.nn.pipe.balance import balance_by_size, balance_by_time
from fairscale.nn.pipe.balance.blockpartition import solve
from fairscale.nn.pipe.skip import Namespace, pop, skippable, stash
from fairscale.testing.models import build
from fairscale.testing.reference import Trajectory, compare, train_reference
from planner.capture import LossModule


def _seq(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


CONFIGS = [([5], 1, "never"), ([2, 3], 2, "except_last"), ([1, 2, 2], 3, "always"), ([2, 2, 1], 4, "except_last"),
           ([1, 1, 1, 1, 1], 5, "always"), ([3, 2], 3, "never")]


@pytest.mark.parametrize("balance,chunks,ckpt", CONFIGS)
def test_output_and_gradients_equal_sequential(balance, chunks, ckpt) -> None:
    ref = _seq()
    pipe = Pipe(copy.deepcopy(ref), balance, chunks=chunks, checkpoint=ckpt)
    x = torch.randn(10, 6, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(pipe(x), ref(x), rtol=0, atol=1e-6)
    (pipe(x) ** 2).sum().backward()
    (ref(x) ** 2).sum().backward()
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert pipe.balance == balance and len(pipe.partitions) == len(balance) and len(pipe) == 5


def test_checkpointing_saves_activations() -> None:
    """'always' keeps no activation of the layers' forward, 'never' keeps every saved activation.

    The layers run on the Pipe's worker threads, so the saved-tensor hook is installed around
    each layer's forward (torch's saved-tensor hooks are per thread)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    class Measured(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return self.inner(x)

    def saved_bytes(mode: str) -> int:
        nonlocal total
        total = 0
        pipe = Pipe(nn.Sequential(*[Measured(m) for m in _seq()]), [2, 3], chunks=2, checkpoint=mode)
        pipe(torch.randn(64, 6, requires_grad=True))
        return total

    assert saved_bytes("never") > 0
    assert saved_bytes("always") < saved_bytes("never") / 2


def test_tuple_inputs_and_outputs() -> None:
    class Two(nn.Module):
        def forward(self, ab: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            a, b = ab
            return a + b, a * b

    class Sum(nn.Module):
        def forward(self, ab: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            a, b = ab
            return a.sum(-1, keepdim=True), b

    seq = nn.Sequential(Two(), Sum())
    a, b = torch.randn(6, 3), torch.randn(6, 3)
    got = Pipe(seq, [1, 1], chunks=3)((a, b))
    want = seq((a, b))
    assert isinstance(got, tuple) and len(got) == 2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


# ---------------------------------------------------------------------------------------------- skips

@skippable(stash=["skip"])
class StashLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor):
        yield stash("skip", x)
        return self.lin(x)


@skippable(pop=["skip"])
class PopLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor):
        skip = yield pop("skip")
        return self.lin(x) * skip


def _skip_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(StashLayer(), nn.Tanh(), nn.Linear(4, 4), PopLayer())


def _dense_skip(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    s, t, lin, p = model
    h = lin(t(s.module.lin(x)))
    return p.module.lin(h) * x


@pytest.mark.parametrize("ckpt", ["never", "except_last", "always"])
def test_skip_connection_across_partitions(ckpt: str) -> None:
    model = _skip_model()
    x = torch.randn(8, 4, requires_grad=True)
    ref = copy.deepcopy(model)
    xr = x.detach().clone().requires_grad_()
    pipe = Pipe(model, [1, 2, 1], chunks=4, checkpoint=ckpt)
    out = pipe(x)
    want = _dense_skip(ref, xr)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    out.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)  # gradient flows through the skip
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_skippable_sequential_runs_without_pipe() -> None:
    model = _skip_model()
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), _dense_skip(model, x))


def test_namespaces_isolate_repeated_names() -> None:
    ns1, ns2 = Namespace(), Namespace()
    torch.manual_seed(0)
    model = nn.Sequential(StashLayer().isolate(ns1), StashLayer().isolate(ns2),
                          PopLayer().isolate(ns2), PopLayer().isolate(ns1))
    x = torch.randn(4, 4)
    s1, s2, p2, p1 = model
    h1 = s1.module.lin(x)
    h2 = s2.module.lin(h1)
    want = p1.module.lin(p2.module.lin(h2) * h1) * x
    torch.testing.assert_close(Pipe(model, [2, 2], chunks=2)(x), want)


def test_unmatched_skips_are_listed() -> None:
    with pytest.raises(TypeError, match="no module declared 'skip' as poppable but stashed"):
        Pipe(nn.Sequential(StashLayer(), nn.Tanh()), [1, 1])
    with pytest.raises(TypeError, match="'0' declared 'skip' as poppable but it was not stashed"):
        Pipe(nn.Sequential(PopLayer(), StashLayer()), [1, 1])
    with pytest.raises(TypeError, match="'1' redeclared 'skip' as stashable but not isolated by namespace"):
        Pipe(nn.Sequential(StashLayer(), StashLayer(), PopLayer()), [1, 2])


def test_undeclared_stash_raises() -> None:
    @skippable(stash=["a"])
    class Bad(nn.Module):
        def forward(self, x):
            yield stash("b", x)
            return x

    with pytest.raises(RuntimeError, match="'b' has not been declared as stashable"):
        Bad()(torch.zeros(1))


# ---------------------------------------------------------------------------------------------- batch norm

def test_deferred_batch_norm_tracks_the_whole_mini_batch() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU())
    pipe = Pipe(copy.deepcopy(ref), [2, 1], chunks=4, deferred_batch_norm=True, checkpoint="always")
    x = torch.randn(16, 4)
    for _ in range(2):
        pipe(x).sum().backward()
        ref(x)
    bn_ref, bn = ref[1], pipe[1]
    torch.testing.assert_close(bn.running_mean, bn_ref.running_mean, rtol=1e-5, atol=1e-6)
    # FairScale 0.4.13 takes the mini-batch's biased variance (nn.BatchNorm the unbiased one)
    var = ref[0](x).detach().var(0, unbiased=False)
    running_var = torch.ones(6)
    for _ in range(2):
        running_var = 0.9 * running_var + 0.1 * var
    torch.testing.assert_close(bn.running_var, running_var, rtol=1e-5, atol=1e-6)
    assert int(bn.num_batches_tracked) == 2
    assert {"sum", "sum_squares"} <= {k.rpartition(".")[2] for k in pipe.state_dict()}  # 0.4.13's keys
    pipe.eval()
    want = torch.relu(torch.nn.functional.batch_norm(ref[0](x), bn.running_mean, running_var, bn.weight, bn.bias,
                                                     False, 0.0, bn.eps))
    torch.testing.assert_close(pipe(x), want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- balance

def test_blockpartition_by_hand() -> None:
    assert solve([1, 1, 1, 1], 2) == [[1, 1], [1, 1]]
    assert solve([5, 1, 1, 1, 1, 1], 2) == [[5], [1, 1, 1, 1, 1]]
    assert solve([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [[1, 2, 3, 4, 5], [6, 7], [8, 9]]  # max 17 (15, 13, 17)
    with pytest.raises(ValueError, match="cannot split 2 layers into 3"):
        solve([1, 1], 3)


def test_balance_by_size_isolates_the_big_layer() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 512), nn.Linear(512, 512), nn.Linear(512, 8), nn.Linear(8, 8))
    balance = balance_by_size(3, model, torch.randn(4, 8), chunks=2)
    assert sum(balance) == 5 and len(balance) == 3
    assert balance[1] == 1  # the 512x512 layer sits alone
    Pipe(model, balance, chunks=2)(torch.randn(4, 8))


def test_balance_by_time_gives_a_valid_balance() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 256), nn.Linear(256, 256), nn.Linear(256, 8))
    balance = balance_by_time(2, model, torch.randn(32, 8), timeout=0.05)
    assert sum(balance) == 4 and len(balance) == 2 and min(balance) >= 1
    assert all(p.grad is None for p in model.parameters())  # profiling leaves no gradients behind


# ---------------------------------------------------------------------------------------------- errors

@pytest.mark.parametrize("kwargs,exc,text", [
    (dict(balance=None), ValueError, "balance is required"),
    (dict(balance=[2, 2]), BalanceError, r"module and sum of balance have different length \(module: 5, sum of balance: 4\)"),
    (dict(balance=[5, 0]), BalanceError, "all balance numbers must be positive integer"),
    (dict(balance=[5], chunks=0), ValueError, "number of chunks must be positive integer"),
    (dict(balance=[5], checkpoint="sometimes"), ValueError, "checkpoint is not one of"),
    (dict(balance=[2, 3], devices=["cpu"]), IndexError, r"too few devices to hold given partitions \(devices: 1, partitions: 2\)"),
])
def test_argument_errors(kwargs, exc, text) -> None:
    with pytest.raises(exc, match=text):
        Pipe(_seq(), **kwargs)


def test_non_sequential_and_cuda_without_gpu() -> None:
    with pytest.raises(TypeError, match="module must be nn.Sequential"):
        Pipe(nn.Linear(2, 2), [1])  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            Pipe(_seq(), [5], devices=["cuda:0"])


# ---------------------------------------------------------------------------------------------- ranks

BATCH, STEPS = 8, 3


def _pack(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _rank_pipe(rank: int, world: int) -> bytes:
    out = {}
    for name, balance, chunks, ckpt in (("a", [2, 2], 2, "except_last"), ("b", [1, 1, 1, 1], 1, "always")):
        case = build("mlp")
        case.model.layers = Pipe(case.model.layers, balance, chunks=chunks, checkpoint=ckpt)
        wrapped = LossModule(case.model, case.loss_fn)
        opt = torch.optim.Adam(case.model.parameters(), lr=1e-2)
        traj, per = Trajectory(), BATCH // world
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            loss = wrapped(*(t[rank * per:(rank + 1) * per] for t in case.make_batch(step, BATCH)))
            loss.backward()
            for p in case.model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
            opt.step()
            g = loss.detach().clone()
            dist.all_reduce(g)
            traj.losses.append(g.item() / world)
        # Pipe keeps the layers themselves, so the Sequential's own keys read back unchanged
        traj.params = {f"layers.{k}": v.clone() for k, v in nn.Sequential(*case.model.layers).state_dict().items()}
        out[name] = traj
    return _pack(out)


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_pipes_train_like_single_process(world: int) -> None:
    ref = train_reference(lambda: build("mlp"), steps=STEPS, global_batch=BATCH)
    for r in fairscale.launch(_rank_pipe, devices=world):
        got = torch.load(io.BytesIO(r), weights_only=False)
        compare(ref, got["a"])
        compare(ref, got["b"])


def test_is_checkpointing_and_is_recomputing_flags() -> None:
    from fairscale.nn.pipe import is_checkpointing, is_recomputing

    seen: list[tuple[bool, bool]] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((is_checkpointing(), is_recomputing()))
            return x * x  # saves x for backward, so the checkpointed cell is recomputed

    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), Probe()), [1, 1], chunks=2, checkpoint="except_last")
    pipe(torch.randn(4, 2)).sum().backward()
    # micro-batch 0 is checkpointed (forward, then recomputed in backward); micro-batch 1 is not
    assert sorted(seen) == sorted([(True, False), (False, False), (False, True)])


# ---------------------------------------------------------------------------------------------- multi-process

def _mp_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 32), nn.Tanh()]
    for _ in range(3):
        layers += [nn.Linear(32, 32), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(32, 4))  # 9 children


def _mp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)


MP_CASES = {2: [("gpipe", [4, 5], 2, 1), ("interleaved", [2, 2, 2, 3], 2, 2)],
            4: [("1f1b", [3, 2, 2, 2], 8, 1)]}


def _mp_sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def _mp_rank(rank: int, world: int) -> bytes:
    from fairscale.nn.pipe.multiprocess import MultiProcessPipe

    out = []
    for kind, balance, chunks, v in MP_CASES[world]:
        pipe = MultiProcessPipe(_mp_model(), balance, chunks=chunks, loss_fn=nn.functional.cross_entropy,
                                example_batch=_mp_batch(0), schedule=kind, virtual_stages=v)
        opt = _mp_sgd(pipe.parameters())
        losses = []
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            losses.append(pipe.step(*_mp_batch(step)))
            opt.step()
        out.append((losses, {k: v.clone() for k, v in pipe.state_dict().items()}))
    if world == 4:  # two pipelines of 2 ranks (group=), data parallel across them
        pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        half = BATCH // 2

        def my_half(step: int) -> tuple[torch.Tensor, ...]:
            return tuple(t[(rank // 2) * half:(rank // 2 + 1) * half] for t in _mp_batch(step))

        pipe = MultiProcessPipe(_mp_model(), [4, 5], chunks=2, loss_fn=nn.functional.cross_entropy,
                                example_batch=my_half(0), schedule="1f1b", group=pipes[rank // 2])
        opt = _mp_sgd(pipe.parameters())
        losses = []
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            loss = torch.tensor(pipe.step(*my_half(step)))
            for p in pipe.parameters():
                dist.all_reduce(p.grad, group=replicas[rank % 2])
                p.grad.div_(2)
            dist.all_reduce(loss, group=replicas[rank % 2])
            losses.append(loss.item() / 2)
            opt.step()
        out.append((losses, {k: v.clone() for k, v in pipe.state_dict().items()}))
    try:
        MultiProcessPipe(_mp_model(), MP_CASES[world][0][1], chunks=2, loss_fn=nn.functional.cross_entropy,
                         example_batch=_mp_batch(0), checkpoint="except_last")
    except NotImplementedError as e:
        out.append(str(e))
    return _pack(out)


@pytest.mark.parametrize("world", [2, 4])
def test_multiprocess_pipe_trains_like_single_process(world: int) -> None:
    model = _mp_model()
    opt = _mp_sgd(model.parameters())
    ref_losses = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _mp_batch(step)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    ref = model.state_dict()
    # warm torch.export up once here, so the forked ranks do not each pay its first-call cost
    from planner.capture import capture
    capture(_mp_model(), tuple(t[:2] for t in _mp_batch(0)), loss_fn=nn.functional.cross_entropy, annotate=False)
    per_rank = [torch.load(io.BytesIO(r), weights_only=False) for r in fairscale.launch(_mp_rank, devices=world)]
    for i, case in enumerate(MP_CASES[world]):
        params: dict[str, torch.Tensor] = {}
        for r in per_rank:
            losses, state = r[i]
            assert losses == pytest.approx(ref_losses, rel=1e-5), case
            params.update(state)
        assert sorted(params) == sorted(ref), case  # every parameter lives on some rank
        for k, v in ref.items():
            torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-5, msg=lambda m: f"{case} {k}: {m}")
    assert "checkpoint='except_last'" in per_rank[0][-1] and "not supported" in per_rank[0][-1]
    if world == 4:  # pp=2 × 2 replicas
        i = len(MP_CASES[world])
        for group in ((0, 1), (2, 3)):
            params = {}
            for r in group:
                losses, state = per_rank[r][i]
                assert losses == pytest.approx(ref_losses, rel=1e-5)
                params.update(state)
            for k, v in ref.items():
                torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-5)
