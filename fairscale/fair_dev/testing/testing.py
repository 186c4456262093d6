"""Test helpers with FairScale 0.4.13's names: spawn ranks, skip by hardware, compare results.

    from fairscale.fair_dev.testing.testing import dist_init, spawn_for_all_world_sizes, objects_are_equal

    def run(rank, world_size, filename, filename_rpc):
        dist_init(rank, world_size, filename, filename_rpc)     # gloo on CPU, NCCL with enough GPUs
        ...

    def test_it():
        spawn_for_all_world_sizes(run)                          # each world size of get_world_sizes()

``@torch_spawn([2])`` on a function ``foo(...)`` registers ``test_foo`` in the calling module, which
runs ``foo`` on 2 spawned ranks with torch.distributed, RPC and a model-parallel group of 1
initialized. :func:`get_world_sizes` follows the CUDA device count (``[1, 2, 4, 8]`` up to it), so
on a CPU-only machine it is empty: set it (as ``benchmarks/conformance/cpu_conftest.py`` does) to
run spawned tests on gloo.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import inspect
import logging
import multiprocessing
import os
import random
import subprocess
import sys
import tempfile
from statistics import mean
from typing import Any, Callable, Generator, Iterator

import numpy
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed import rpc

from fairscale.fair_dev.testing.models import GPT2, DeviceAndTypeCheckModule, IdentityLayer  # noqa: F401
from fairscale.internal import torch_version
from fairscale.nn.model_parallel import destroy_model_parallel, initialize_model_parallel
from fairscale.nn.model_parallel.random import model_parallel_cuda_manual_seed

# ---------------------------------------------------------------------------------- skips by hardware

_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0

skip_if_cuda = pytest.mark.skipif(_gpus > 0, reason="CPU-only test (skipped where CUDA is available)")
skip_if_no_cuda = pytest.mark.skipif(_gpus < 1, reason="CUDA required")
skip_if_single_gpu = pytest.mark.skipif(_gpus < 2, reason="multiple GPUs required")
skip_if_less_than_four_gpu = pytest.mark.skipif(_gpus < 4, reason="4 GPUs or more required")
skip_if_py38 = pytest.mark.skipif(sys.version_info[:2] == (3, 8), reason="Python 3.8 is skipped")
skip_if_py39_no_cuda = pytest.mark.skipif(_gpus < 1 and sys.version_info[:2] == (3, 9),
                                          reason="Python 3.9 without CUDA is skipped")
skip_due_to_flakyness = pytest.mark.skip(reason="flaky test, to be fixed or removed")

available_devices = ["cpu"] + (["cuda"] if _gpus else [])

filename_mpi: str | None = None


def in_circle_ci() -> bool:
    return os.path.exists("/home/circleci")


def skip_a_test_if_in_CI() -> None:  # noqa: N802 - FairScale's name
    if in_circle_ci():
        pytest.skip("skipped in CircleCI (failure not reproducible locally)")


# ---------------------------------------------------------------------------------- determinism


def set_random_seed(seed: int, model_parallel: bool = True) -> None:
    """Seed Python, numpy and torch (and the model-parallel CUDA RNG tracker if asked)."""
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    if model_parallel:
        model_parallel_cuda_manual_seed(seed)


def make_cudnn_deterministic() -> None:
    """Deterministic cuDNN kernels and no TF32 (which rounds matmuls differently run to run)."""
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


_smi_version: str | None = None


def torch_cuda_version(compiled: bool = False) -> tuple[int, ...]:
    """CUDA ``(major, minor)``: torch's build (``compiled``) or the driver's (from ``nvidia-smi``)."""
    global _smi_version
    if compiled:
        text = torch.version.cuda or ""
    else:
        if _smi_version is None:
            out = subprocess.check_output(["nvidia-smi"]).decode()
            line = next(line for line in out.splitlines() if "CUDA Version" in line)
            _smi_version = line.split("CUDA Version:")[1].split()[0]
        text = _smi_version
    return tuple(int(n) for n in text.split(".")[:2])


# ---------------------------------------------------------------------------------- process launch


def dist_init(rank: int, world_size: int, filename: str, filename_rpc: str = "") -> bool:
    """Join a ``world_size`` process group through ``file://filename`` (NCCL when CUDA has a GPU per
    rank, else gloo) and an RPC world through ``filename_rpc``, named ``Test<rank>``.

    Returns False, without initializing, when CUDA is present but has fewer GPUs than ranks.
    """
    with contextlib.suppress(Exception):
        rpc.shutdown()
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["RANK"] = str(rank)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        logging.warning(f"world size {world_size} needs as many GPUs; found {torch.cuda.device_count()}")
        return False
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, init_method=f"file://{filename}")
    rpc.init_rpc(f"Test{rank}", rank=rank, world_size=world_size, backend=rpc.BackendType.TENSORPIPE,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"file://{filename_rpc}"))
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    return True


def get_worker_map() -> dict[int, str]:
    """RPC worker names by rank, as :func:`dist_init` registers them."""
    return {rank: f"Test{rank}" for rank in range(dist.get_world_size())}


def get_world_sizes() -> list[int]:
    """World sizes spawned tests run at: 1, 2, 4, 8 up to the number of CUDA devices."""
    return [n for n in (1, 2, 4, 8) if n <= _gpus]


def test_runner(rank: int, test_func: Callable, deterministic: bool = False, *args: Any, **kwargs: Any) -> None:
    """What each spawned rank runs: ``test_func(rank, *args)``, seeded if ``deterministic``."""
    if deterministic:
        make_cudnn_deterministic()
        torch.manual_seed(1357)
    test_func(rank, *args, **kwargs)


test_runner.__test__ = False  # type: ignore[attr-defined]  # a helper, not a pytest test


def spawn_for_all_world_sizes(test_func: Callable, world_sizes: list[int] | None = None, args: Any = (),
                              deterministic: bool = False) -> None:
    """Run ``test_func(rank, world_size, filename, filename_rpc, *args)`` on ``world_size`` spawned
    processes for each world size (default :func:`get_world_sizes`), with fresh rendezvous files."""
    for world_size in get_world_sizes() if world_sizes is None else world_sizes:
        with temp_files_ctx(2) as (filename, filename_rpc):
            mp.spawn(test_runner, args=(test_func, deterministic, world_size, filename, filename_rpc, *args),
                     nprocs=world_size, join=True)


def worker_process(rank: int, world_size: int, filename: str, filename_rpc: str, func: Callable, args: Any,
                   error_queue: Any) -> None:
    """A :func:`torch_spawn` rank: initialize, run ``func(*args)``, tear down; a ``pytest.skip`` in
    ``func`` is sent to the parent through ``error_queue``."""
    if not dist_init(rank, world_size, filename, filename_rpc):
        teardown()
        return
    initialize_model_parallel(1, world_size, pipeline_backend="gloo")
    try:
        func(*args)
        # a rank that tears its groups down while another is still connecting a group makes that
        # one fail ("connection closed by peer"); a bounded barrier first (a failed rank cannot hang it)
        with contextlib.suppress(Exception):
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
        teardown()
    except BaseException as e:
        logging.warning(f"rank {rank}: {e}")
        teardown()
        if type(e).__name__ == "Skipped":
            error_queue.put(str(e))
            return
        raise


def teardown() -> None:
    """Undo :func:`dist_init` and the model-parallel groups."""
    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    with contextlib.suppress(Exception):
        rpc.shutdown(graceful=False)


def torch_spawn(world_sizes: list[int] | None = None) -> Callable[[Callable], Callable]:
    """Decorate ``foo`` (whose name must not start with ``test``) to register ``test_foo`` in the
    calling module, running ``foo`` on each of ``world_sizes`` spawned ranks (default
    :func:`get_world_sizes`); ``foo``'s parameters other than ``rank`` come from pytest fixtures or
    parametrization and are passed positionally."""

    def decorate(func: Callable) -> Callable:
        if func.__name__.startswith("test"):
            raise ValueError(f"a function marked with @torch_spawn ({func.__name__!r}) must not start with "
                             "'test': pytest would collect it without the spawn wrapper")
        sizes = get_world_sizes() if world_sizes is None else world_sizes
        params = [p for p in inspect.signature(func).parameters if p != "rank"]

        @functools.wraps(func)
        def test(*args: Any, **kwargs: Any) -> None:
            assert not args, "torch_spawn tests take fixtures and parameters by name"
            values = tuple(kwargs[p] for p in params)
            errors = multiprocessing.get_context("spawn").SimpleQueue()
            spawn_for_all_world_sizes(worker_process, sizes, (func, values, errors))
            if not errors.empty():
                pytest.skip(errors.get())

        caller = inspect.getmodule(inspect.currentframe().f_back)  # type: ignore[union-attr]
        setattr(caller, f"test_{func.__name__}", test)
        return func

    return decorate


# ---------------------------------------------------------------------------------- comparisons


def objects_are_equal(a: Any, b: Any, raise_exception: bool = False, dict_key: str | None = None,
                      rtol: float | None = None, atol: float | None = None) -> bool:
    """Deep equality of nested dicts, lists, tuples and sets; tensors must match in shape, dtype and
    device and be close (``torch.testing.assert_close``; ``rtol``/``atol`` as there). With
    ``raise_exception`` the first difference raises, naming the dict key it was found under."""

    def fail(msg: str, exc: type[Exception] = ValueError) -> bool:
        if raise_exception:
            raise exc(msg)
        return False

    if type(a) is not type(b):
        return fail(f"type mismatch {type(a)} vs. {type(b)}")
    if isinstance(a, dict):
        if set(a) != set(b):
            return fail(f"keys mismatch {a.keys()} vs. {b.keys()}")
        return all(objects_are_equal(a[k], b[k], raise_exception, k, rtol, atol) for k in a)
    if isinstance(a, (list, tuple, set)):
        if len(a) != len(b):
            return fail(f"length mismatch {len(a)} vs. {len(b)}")
        return all(objects_are_equal(x, y, raise_exception, None, rtol, atol) for x, y in zip(a, b))
    if not torch.is_tensor(a):
        return a == b
    if a.size() != b.size() or a.dtype != b.dtype or a.device != b.device:
        return fail(f"sizes: {a.size()} vs. {b.size()}, types: {a.dtype} vs. {b.dtype}, "
                    f"device: {a.device} vs. {b.device}", AssertionError)
    try:
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
        return True
    except (AssertionError, RuntimeError) as e:
        if not raise_exception:
            return False
        if dict_key and isinstance(e, AssertionError):
            raise AssertionError(f"For dict key '{dict_key}': {e.args[0]}") from None
        raise


def check_same_model_params(model_a: nn.Module, model_b: nn.Module, message: str = "") -> None:
    """Parameters close (atol 1e-3) and buffers close, pairwise in registration order."""
    for p_a, p_b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.allclose(p_a, p_b, atol=1e-3), f"Model parameters differ\n{p_a} {p_b}\n{message}"
    for b_a, b_b in zip(model_a.buffers(), model_b.buffers()):
        assert torch.allclose(b_a, b_b), f"Model buffers differ {b_a} - {b_b}\n{message}"


def check_same_models_across_ranks(model: nn.Module, process_group: Any, params_should_be_equal: bool,
                                   check_broadcast_buffers: bool) -> None:
    """On the group's rank 0, check every rank holds the same parameters (and buffers, if asked)."""
    world_size = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    tensors = list(model.parameters()) + (list(model.buffers()) if check_broadcast_buffers else [])
    for t in tensors:
        copies = [torch.empty_like(t) for _ in range(world_size)]
        dist.all_gather(copies, t.detach().contiguous(), group=process_group)
        if rank == 0 and params_should_be_equal:
            for other in copies[1:]:
                assert torch.equal(copies[0], other), f"Models differ in between ranks {copies[0]} - {other}"


def state_dict_norm(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum of the norms of a state dict's tensors (integers as floats): a cheap fingerprint."""
    total = torch.zeros(1)
    for v in state.values():
        total += (v if v.is_floating_point() else v.float()).norm().cpu()
    return total


# ---------------------------------------------------------------------------------- test doubles


class DummyProcessGroup:
    """A stand-in process group with only ``rank()`` and ``size()`` (for wrappers built without
    torch.distributed; any collective on it fails)."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank = rank
        self._size = size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class SGDWithPausingCompute(torch.optim.SGD):
    """SGD that, after each step, queues a long kernel on a side CUDA stream and scales parameters by
    ``1 + rank/10``: checks that wrappers synchronize streams before reading updated parameters."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.rank = kwargs.pop("rank")
        super().__init__(*args, **kwargs)

    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure=closure)
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda._sleep(100_000_000)
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        p *= 1.0 + self.rank / 10.0
        return loss


@functools.lru_cache()
def get_cycles_per_ms() -> float:
    """GPU clock cycles per millisecond for ``torch.cuda._sleep`` (mean of 10 runs without the 2
    fastest and 2 slowest)."""

    def once() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(1_000_000)
        end.record()
        end.synchronize()
        return 1_000_000 / start.elapsed_time(end)

    runs = sorted(once() for _ in range(10))
    return mean(runs[2:-2])


# ---------------------------------------------------------------------------------- files and memory


def rmf(filename: str) -> None:
    """``rm -f``."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(filename)


@contextlib.contextmanager
def in_temporary_directory() -> Generator[str, None, None]:
    """Run the block in a fresh temporary directory (removed afterwards)."""
    old = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            yield tmp
        finally:
            os.chdir(old)


@contextlib.contextmanager
def temp_files_ctx(num: int) -> Iterator[tuple[str, ...]]:
    """``num`` temporary file names, removed afterwards (if still there)."""
    files = []
    for _ in range(num):
        fd, name = tempfile.mkstemp()
        os.close(fd)
        files.append(name)
    try:
        yield tuple(files)
    finally:
        for name in files:
            rmf(name)


def dump_all_tensors(rank: int) -> None:
    """Print every live tensor (on rank 0), for memory debugging."""
    if rank != 0:
        return
    for obj in gc.get_objects():
        with contextlib.suppress(Exception):
            t = obj if torch.is_tensor(obj) else getattr(obj, "data", None)
            if torch.is_tensor(t):
                print(type(obj), t.shape, t.dtype, t.device, t.untyped_storage().size())
    if torch.cuda.is_available():
        print(torch.cuda.memory_summary())


def get_smi_memory() -> float:
    """This process's GPU memory in MB as ``nvidia-smi`` reports it (0 if it has none)."""
    pid = str(os.getpid())
    for line in torch.cuda.list_gpu_processes().splitlines():
        if pid in line:
            return float(line.split()[3])
    return 0.0


__all__ = ["skip_if_cuda", "skip_if_no_cuda", "skip_if_single_gpu", "skip_if_less_than_four_gpu", "skip_if_py38",
           "skip_if_py39_no_cuda", "skip_due_to_flakyness", "available_devices", "in_circle_ci",
           "skip_a_test_if_in_CI", "set_random_seed", "make_cudnn_deterministic", "torch_cuda_version",
           "dist_init", "get_worker_map", "get_world_sizes", "spawn_for_all_world_sizes", "worker_process",
           "teardown", "torch_spawn", "objects_are_equal", "check_same_model_params",
           "check_same_models_across_ranks", "state_dict_norm", "DummyProcessGroup", "SGDWithPausingCompute",
           "get_cycles_per_ms", "rmf", "in_temporary_directory", "temp_files_ctx", "dump_all_tensors",
           "get_smi_memory", "GPT2", "IdentityLayer", "DeviceAndTypeCheckModule", "torch_version"]
