"""A model neither tracer can handle gets a CaptureError that names its source line and what to do."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from planner.capture import CaptureError, capture


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc(x)
        return -x


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.inp(x)).pow(2).mean()


LINE = inspect.getsourcelines(Gate.forward)[1] + 1  # the `if x.sum() > 0:` line


FORBIDDEN = ("leaf_modules", "concrete_args", "annotate=", "tracer=", "capture(", "call_module", "%", "arg0_1")


def _no_internal_advice(msg: str) -> None:
    """Only remedies the public API can act on; no fx node, no graph dump, a few lines."""
    assert not [w for w in FORBIDDEN if w in msg], msg
    assert len(msg.splitlines()) <= 14, msg


def test_data_dependent_branch_names_the_line_and_the_fixes(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(CaptureError) as info:
        capture(Branchy(), (torch.randn(2, 4),))
    msg = str(info.value)
    assert msg.startswith(f"could not capture Branchy: its forward needs a tensor's value, not only its shape at "
                          f"{__file__}:{LINE} (module gate, Gate.forward), at op aten.item.default:\n")
    assert f"  -> {LINE:>4} |         if x.sum() > 0:" in msg and f"{LINE + 1:>4} |             return self.fc(x)" in msg
    assert "What to do: compute both sides and select with torch.where(condition, a, b)" in msg
    assert "  torch.fx: TraceError: symbolically traced variables cannot be used as inputs to control flow" in msg
    _no_internal_advice(msg)
    assert "arg0_1" not in capfd.readouterr().err  # torch's graph-so-far dump (forward(self, arg0_1, ...)) is not printed


def test_a_leaf_is_not_a_remedy_for_data_dependence() -> None:
    """Marked as a leaf, fx keeps Gate as one opaque node and the graph runs, but the planner's facts
    are computed on fake tensors, where the branch has no value either; so no message suggests it."""
    model = Branchy()
    x = torch.randn(2, 4)
    with pytest.raises(CaptureError) as info:
        capture(model, (x,), leaf_modules=(Gate,))
    msg = str(info.value)
    assert msg.startswith(f"captured Branchy with torch.fx, but cannot compute the facts of {__file__}:{LINE} on "
                          "fake tensors (shapes only, no values):\n")
    assert "The result or a branch there depends on the data" in msg
    _no_internal_advice(msg.replace("captured Branchy with torch.fx", ""))
    graph = capture(model, (x,), leaf_modules=(Gate,), annotate=False)
    assert graph.tracer == "fx"
    assert [n.target for n in graph.gm.graph.nodes if n.op == "call_module"] == ["model.gate"]
    assert [layer.name for layer in graph.layers] == ["inp", "gate"]
    assert graph.layer("gate").params == ["gate.fc.weight", "gate.fc.bias"]
    torch.testing.assert_close(graph.gm(x), model(x))


def test_single_tracer_failure_says_cannot():
    with pytest.raises(CaptureError, match=r"^could not capture Branchy: its forward needs a tensor's value"):
        capture(Branchy(), (torch.randn(2, 4),), tracer="fx")


class Item(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = int((x > 0).sum().item())
        return self.a(x)[:n].mean()


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return h[h > 0].sum()


class Transposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x.t()).mean()


def _line(cls: type, text: str) -> int:
    lines, start = inspect.getsourcelines(cls.forward)
    return start + next(i for i, line in enumerate(lines) if text in line)


def test_item_and_data_dependent_shapes_name_the_line(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(CaptureError) as info:
        capture(Item(), (torch.randn(2, 4),))
    msg = str(info.value)
    line = _line(Item, ".item()")
    assert msg.startswith(f"could not capture Item: its forward needs a tensor's value, not only its shape at "
                          f"{__file__}:{line} (module (the model), Item.forward), at op aten.item.default:\n"), msg
    _no_internal_advice(msg)
    # a boolean mask (an unbacked size): the facts take its size on the example batch (a real model)
    x = torch.randn(2, 4)
    model = Masked()
    assert torch.equal(capture(model, (x,)).gm(x), model(x))
    # on meta there is no example value: refused, naming the op
    with torch.device("meta"):
        on_meta = Masked()
    with pytest.raises(CaptureError) as info:
        capture(on_meta, (torch.randn(2, 4, device="meta"),))
    msg = str(info.value)
    assert msg.startswith("captured Masked with torch.fx, but cannot compute the facts of "), msg
    assert "DynamicOutputShapeException" in msg and "torch.where(m, x, 0).sum() rather than x[m].sum()" in msg
    assert "Traceback" not in capfd.readouterr().err  # FakeTensor's error log is silenced


def test_a_forward_that_fails_on_the_inputs_is_reported_from_the_tracer_that_ran_it() -> None:
    """export runs the code and fails on the shapes; fx traces without running it, and its facts then
    fail on the same matmul: the export failure, at the user's line, is the one reported."""
    with pytest.raises(CaptureError) as info:
        capture(Transposed(), (torch.randn(2, 4),))
    msg = str(info.value)
    assert msg.startswith(f"could not capture Transposed: torch.export cannot trace its forward on the example inputs "
                          f"at {__file__}:{_line(Transposed, 'x.t()')} (module (the model), Transposed.forward):\n"), msg
    assert "if model(*example_inputs) raises this outside fairscale too, fix the inputs or the model" in msg
    assert "  torch.export: RuntimeError: a and b must have same reduction dim" in msg
    _no_internal_advice(msg)


class Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, square: bool) -> torch.Tensor:
        y = self.fc(x)
        if square:
            y = y * y
        return y.mean()


def test_concrete_args_fix_a_python_branch_for_fx():
    model, x = Flagged(), torch.randn(2, 4)
    graph = capture(model, (x, True), tracer="fx", concrete_args={"batch_1": True})
    assert graph.tracer == "fx"
    torch.testing.assert_close(graph.gm(x, True), model(x, True))
    assert graph.flops_per_step == 2 * 2 * 4 * 4 * 2  # fwd + weight grad; x needs no gradient
    with pytest.raises(ValueError, match=r"^tracer='fx' takes a flat tuple of tensors as example_inputs \(other "):
        capture(model, (x, True), tracer="fx")


class Router(nn.Module):
    """mistral-src's routing: the tokens of each expert found with torch.where on a mask."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 3)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = torch.where(chosen == i)[0]
            out[rows] += expert(x[rows])
        return out


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = Router()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x).sum()


def test_data_dependent_routing_is_captured_with_the_example_batchs_sizes() -> None:
    """mistral-src's MoE routing (torch.where on a mask, then indexing) has sizes from the data:
    a real model's facts take them from the example batch (was: refused at capture); the captured
    graph computes the model's loss and its experts are counted."""
    torch.manual_seed(0)
    model, x = Routed(), torch.randn(6, 4)
    graph = capture(model, (x,))
    assert torch.allclose(graph.gm(x), model(x), rtol=1e-6, atol=0)
    assert sum(layer.flops_fwd for layer in graph.layers if layer.name.startswith("moe.experts")) > 0


def test_data_dependent_routing_on_meta_is_refused_naming_the_module_and_op() -> None:
    with torch.device("meta"):
        model = Routed()
    with pytest.raises(CaptureError) as info:
        capture(model, (torch.randn(6, 4, device="meta"),))
    assert "in module moe) on fake tensors" in str(info.value) and "DynamicOutputShapeException" in str(info.value)


class Matcher(nn.Module):
    """A loss's helper module built inside forward (Hugging Face's HungarianMatcher in DETR/YOLOS)."""

    def forward(self, boxes: torch.Tensor) -> torch.Tensor:
        if not (boxes[:, 2:] >= boxes[:, :2]).all():
            raise ValueError("boxes must be in corner format")
        return boxes.sum()


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Matcher()(self.fc(x))


def test_a_helper_module_built_in_forward_names_the_models_module_that_runs_it() -> None:
    """HF YolosForObjectDetection with labels was refused at the matcher's box check with
    '(HungarianMatcher.generalized_box_iou)', no module of the model (the corpus marks the refusal as
    lacking one): the matcher is built in the loss, not a submodule. The error names the innermost
    module on the stack that is part of the model."""
    model = nn.Sequential()
    model.add_module("det", Head())
    with pytest.raises(CaptureError) as info:
        capture(model, (torch.randn(2, 4),))
    line = inspect.getsourcelines(Matcher.forward)[1] + 1
    assert f"{__file__}:{line} (module det, Matcher.forward), at op " in str(info.value), str(info.value)


class Checked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if labels.max() >= 4:
            raise ValueError("labels must be < 4")
        return nn.functional.cross_entropy(self.fc(x), labels)


def test_an_if_that_only_raises_is_called_a_check_with_its_remedy() -> None:
    """HF Wav2Vec2ForCTC / HubertForCTC with labels were refused at their labels check
    (``if labels.max() >= vocab_size: raise``) with the advice to select with torch.where, which
    fits a branch, not a check in a library's code: the refusal says what the `if` is and what to do."""
    with pytest.raises(CaptureError) as info:
        capture(Checked(), (torch.randn(2, 4), torch.tensor([0, 3])))
    msg = str(info.value)
    assert "This `if` only checks the data and raises" in msg and "call it without" in msg, msg
    assert "torch.where" not in msg, msg
    _no_internal_advice(msg)


class BalancedEncoder(nn.Module):
    """nn.TransformerEncoder (fx keeps it whole) and a class-balanced loss export cannot trace."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.encoder(self.embed(x)).mean(1))
        weight = 1.0 / torch.bincount(y, minlength=4).float().clamp(min=1)
        return nn.functional.cross_entropy(logits, y, weight=weight)


def test_an_fx_fallback_that_keeps_a_torch_module_whole_is_refused_naming_exports_failure() -> None:
    """Export fails on the bincount; fx could trace the model only with nn.TransformerEncoder as one
    opaque call, whose parameters no plan can place: every plan had failed the verifier ("parameter
    'model.encoder.layers.0.self_attn.in_proj_weight' has no provenance"), naming no line."""
    batch = (torch.randn(8, 5, 6), torch.randint(0, 4, (8,)))
    with pytest.raises(CaptureError) as info:
        capture(BalancedEncoder(), batch)
    msg = str(info.value)
    line = inspect.getsourcelines(BalancedEncoder.forward)[1] + 3
    assert f"{__file__}:{line}" in msg and "aten.cross_entropy_loss.default" in msg, msg
    assert "torch.fx: KeptWhole: it could trace the model only by keeping TransformerEncoder whole" in msg
    assert "no provenance" not in msg
    _no_internal_advice(msg)
    assert capture(BalancedEncoder(), batch, tracer="fx").tracer == "fx"  # asked for, it still costs it whole
