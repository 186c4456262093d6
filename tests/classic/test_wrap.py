"""enable_wrap / wrap / auto_wrap and the two policies; auto-wrapped FSDP trains exactly on 2 and 4 ranks."""

from __future__ import annotations

import functools

import pytest
from torch import nn

from fairscale.nn import FullyShardedDataParallel as FSDP
from fairscale.nn.wrap import auto_wrap, config_auto_wrap_policy, default_auto_wrap_policy, enable_wrap, wrap
from fairscale.testing.reference import compare

from classic_harness import launch_ranks as _launch, reference as _reference, train_data_parallel as _train_data_parallel


class Tag(nn.Module):
    """A stand-in wrapper class that records its arguments."""

    def __init__(self, module: nn.Module, **kwargs) -> None:
        super().__init__()
        self.module = module
        self.kwargs = kwargs

    def forward(self, *a, **k):
        return self.module(*a, **k)


def test_wrap_only_inside_the_context_with_precedence():
    lin = nn.Linear(2, 2)
    assert wrap(lin) is lin
    assert auto_wrap(lin) is lin
    lin.wrapper_config = {"b": 2, "c": 2}
    with enable_wrap(wrapper_cls=Tag, a=1, b=1, c=1):
        w = wrap(lin, c=3)
    assert isinstance(w, Tag) and w.module is lin
    assert w.kwargs == {"a": 1, "b": 2, "c": 3}  # overrides > wrapper_config > context


def test_context_errors():
    with pytest.raises(ValueError, match="enable_wrap needs wrapper_cls"):
        with enable_wrap(a=1):
            pass
    with enable_wrap(wrapper_cls=Tag):
        with pytest.raises(RuntimeError, match="already inside an enable_wrap context"):
            with enable_wrap(wrapper_cls=Tag):
                pass
    assert wrap(nn.Linear(1, 1)).__class__ is nn.Linear  # the failed nesting left no context behind


def test_default_policy():
    p = functools.partial(default_auto_wrap_policy, min_num_params=10)
    big, small = nn.Linear(5, 5), nn.Linear(2, 2)
    assert p(module=big, recurse=True, unwrapped_params=30, module_is_root=False)
    assert not p(module=small, recurse=True, unwrapped_params=6, module_is_root=False)
    assert not p(module=nn.MultiheadAttention(4, 2), recurse=True, unwrapped_params=100, module_is_root=False)
    assert p(module=big, recurse=False, unwrapped_params=30, module_is_root=False)
    assert not p(module=nn.ModuleList([big]), recurse=False, unwrapped_params=30, module_is_root=False)
    assert not p(module=small, recurse=False, unwrapped_params=6, module_is_root=True)
    assert p(module=small, recurse=False, unwrapped_params=6, module_is_root=True, skip_params_check_for_root=True)


def test_auto_wrap_is_bottom_up_and_counts_remainders():
    model = nn.Sequential(nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10)), nn.Linear(2, 2))
    with enable_wrap(wrapper_cls=Tag):
        out = auto_wrap(model, auto_wrap_policy=functools.partial(default_auto_wrap_policy, min_num_params=100))
    # each 110-parameter Linear is wrapped; their parent then has 0 unwrapped params and is not;
    # the root keeps 6 and is not wrapped either
    assert out is model
    assert isinstance(model[0][0], Tag) and isinstance(model[0][1], Tag)
    assert isinstance(model[0], nn.Sequential) and isinstance(model[1], nn.Linear)


def test_config_policy_wraps_tagged_modules_with_their_config():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    model[1][0].wrapper_config = {"x": 1}
    with enable_wrap(wrapper_cls=Tag, auto_wrap_policy=config_auto_wrap_policy):
        auto_wrap(model)
    assert isinstance(model[1][0], Tag) and model[1][0].kwargs == {"x": 1}
    assert isinstance(model[0], nn.Linear)


def _fsdp_auto(model: nn.Module) -> nn.Module:
    for block in model.layers:  # per-block settings through wrapper_config
        block.wrapper_config = {"reshard_after_forward": False}
    with enable_wrap(wrapper_cls=FSDP, auto_wrap_policy=config_auto_wrap_policy, reshard_after_forward=True):
        model = auto_wrap(model)
        return wrap(model)  # the root, inside the context


@pytest.mark.parametrize("world", [2, 4])
def test_auto_wrapped_fsdp_trains_exactly(world):
    ref = _reference("mlp")

    def fn(rank, n):
        def unwrap(m):
            blocks = [b for b in m.modules() if isinstance(b, FSDP) and b is not m]
            assert len(blocks) == 4 and all(not b.reshard_after_forward for b in blocks) and m.reshard_after_forward
            return m.state_dict()
        return _train_data_parallel(_fsdp_auto, "mlp", rank, n, unwrap)

    for got in _launch(fn, world):
        compare(ref, got)


def test_public_import_paths():
    import fairscale.nn
    import fairscale.nn.wrap  # noqa: F401 - importing the subpackage must not shadow the function
    from fairscale.experimental.nn import OffloadModel  # noqa: F401
    from fairscale.nn.checkpoint import checkpoint_wrapper as cw
    from fairscale.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel  # noqa: F401
    from fairscale.nn.misc import FlattenParamsWrapper  # noqa: F401

    assert fairscale.nn.wrap is wrap and callable(fairscale.nn.wrap)
    assert fairscale.nn.checkpoint_wrapper is cw
    assert fairscale.nn.FullyShardedDataParallel is FullyShardedDataParallel is FSDP
    for name in fairscale.nn.__all__:
        assert getattr(fairscale.nn, name) is not None, name
