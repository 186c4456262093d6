"""The form of a batch (``fairscale.runtime.batch_form``): positional inputs, or a dict of them by name.

A Hugging Face collator hands a dict that the user passes as ``model(**batch)``. Such a dict as
``example_inputs`` had been refused ("pass the model's inputs as a tuple"), so an HF user wrote
``(input_ids, attention_mask, None, None, None, labels)`` by hand. It is now the batch's form:
every later batch is a dict with the same keys, mapped to the forward's positional inputs.
A batch in a form the module cannot take is refused before anything runs, saying how to pass it:
a dict given to a module compiled from a tuple had run the rank graphs on its keys and failed deep
inside aten (``Unable to cast x to Tensor``); a bare tensor was iterated row by row.
"""

from __future__ import annotations

import pytest
import torch

import fairscale
from fairscale.runtime.batch_form import BatchKeys, keyword_example
from fairscale.testing.models import build

from refusals import BATCH, DP2, refused


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))


def _collated(step: int) -> dict[str, torch.Tensor]:
    """A collator's batch: ids, a padding mask (the last rows padded), labels -100 on the padding."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 64, (BATCH, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[BATCH // 2:, 6:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _rank(rank: int, world: int) -> dict[str, object]:
    case = build("mlp")
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn, plan=DP2)
    x, y = case.make_batch(1, BATCH)
    named = {"inputs": x, "labels": y}
    out: dict[str, object] = {
        "train_step(dict)": refused(lambda: pm.train_step(named)), "pm(**dict)": refused(lambda: pm(**named)),
        "evaluate(dict)": refused(lambda: pm.evaluate(named)), "train_step(tensor)": refused(lambda: pm.train_step(x)),
        "then a tuple": pm.train_step((x, y))}
    model = _llama()
    hf = fairscale.parallelize(model, example_inputs=_collated(0), plan=DP2, optimizer=torch.optim.SGD)  # lr 1e-3
    out["hf losses"] = [hf.train_step(_collated(step)) for step in range(3)]
    batch = _collated(3)
    out["hf pm(**batch)"] = float(hf(**batch).detach())
    out["hf pm(batch)"] = float(hf(batch).detach())
    out["hf evaluate"] = hf.evaluate(batch)
    out["hf other keys"] = refused(lambda: hf.train_step({"input_ids": batch["input_ids"], "labels": batch["labels"]}))
    out["hf tuple"] = refused(lambda: hf.train_step((batch["input_ids"], batch["labels"])))
    out["fairscale.train"] = fairscale.train(_llama(), _collated, steps=2, constraints={"mesh": {"dp": 2}},
                                             optimizer=torch.optim.SGD).losses
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, object]]:
    return fairscale.launch(_rank, devices=2, timeout_s=600)


def test_named_inputs_to_a_module_compiled_from_a_tuple_are_refused_saying_how(runs) -> None:
    for out in runs:
        for call, key in (("pm.train_step", "train_step(dict)"), ("pm(*batch)", "pm(**dict)"),
                          ("pm.evaluate", "evaluate(dict)")):
            assert out[key] == (f"TypeError: {call} takes the global batch as the model's positional inputs, in the "
                                "order example_inputs gave them, not by name (inputs, labels), since example_inputs "
                                "was a tuple: pass a tuple in the order of the forward's parameters, e.g. "
                                "(batch['inputs'], batch['labels']), or give example_inputs to fairscale.parallelize "
                                "as a dict too"), out[key]


def test_a_bare_tensor_is_refused_and_a_tuple_trains(runs) -> None:
    for out in runs:
        assert out["train_step(tensor)"].startswith("TypeError: pm.train_step takes the global batch as a tuple of "
                                                    "the model's positional inputs, got a Tensor of shape (8, 32): "
                                                    "wrap a single input as (x,)"), out["train_step(tensor)"]
        assert isinstance(out["then a tuple"], float)


def test_a_hugging_face_model_trains_on_its_collators_dicts_as_one_process_does(runs) -> None:
    model = _llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    want = []
    for step in range(3):
        loss = model(**_collated(step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(float(loss))
    with torch.no_grad():
        model.eval()
        after = float(model(**_collated(3)).loss)
    for out in runs:
        assert out["hf losses"] == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert out["hf evaluate"] == pytest.approx(after, rel=1e-5)
        assert out["fairscale.train"] == pytest.approx(want[:2], rel=1e-5, abs=1e-6)
    # pm(batch) is this rank's loss on its dp slice, in training mode: the two halves average to the batch's
    model.train()
    with torch.no_grad():
        halves = [float(model(**{k: v[i * BATCH // 2:(i + 1) * BATCH // 2] for k, v in _collated(3).items()}).loss)
                  for i in range(2)]
    assert [out["hf pm(**batch)"] for out in runs] == pytest.approx(halves, rel=1e-5)
    assert [out["hf pm(batch)"] for out in runs] == pytest.approx(halves, rel=1e-5)


def test_a_later_batch_with_other_keys_or_a_short_tuple_is_refused(runs) -> None:
    for out in runs:
        assert out["hf other keys"] == ("TypeError: pm.train_step got a batch with keys (input_ids, labels), but "
                                        "example_inputs gave (input_ids, attention_mask, labels): every batch passes "
                                        "the same inputs; missing: attention_mask"), out["hf other keys"]
        assert out["hf tuple"].startswith("TypeError: pm.train_step got 2 positional inputs, but example_inputs gave "
                                          "(input_ids, attention_mask, labels) by name, 6 inputs in "
                                          "LlamaForCausalLM.forward's order (input_ids, attention_mask, position_ids, "
                                          "past_key_values, inputs_embeds, labels)"), out["hf tuple"]


class _Forward(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, y: torch.Tensor | None = None, *, scale: float = 1.0,
                **kwargs: object) -> torch.Tensor:
        return x.sum()


def test_names_the_forward_cannot_take_positionally_are_refused_at_the_call() -> None:
    x = torch.randn(2, 3)
    keys = BatchKeys.of(_Forward().forward, "_Forward.forward", ["y", "x", "mask"])
    assert keys.params == ("x", "mask", "y") and keys.given == ("y", "x", "mask")
    assert keyword_example(_Forward(), {"x": x, "mask": x, "y": x}, None) == (x, x, x)
    for named, message in [({"x": x, "mask": x, "scale": 2.0}, "'scale', which _Forward.forward is keyword-only"),
                           ({"x": x, "mask": x, "z": x}, "'z', which _Forward.forward is taken only by its **kwargs"),
                           ({"x": x, "y": x}, "gives 'x', 'y' by name but not 'mask', which _Forward.forward requires"),
                           ({}, "example_inputs is an empty dict")]:
        with pytest.raises(TypeError, match=message.replace("*", r"\*")):
            keyword_example(_Forward(), named, None)
    with pytest.raises(TypeError, match=r"example_inputs is a dict \(x, mask\) and loss_fn is given"):
        fairscale.search(_Forward(), {"x": x, "mask": x}, devices=2, loss_fn=torch.nn.functional.mse_loss)
