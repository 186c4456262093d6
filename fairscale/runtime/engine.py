"""One rank of a parallelized model: its compiled stage graphs, pipeline executor and optimizer.

:class:`ParallelModule` is what ``fairscale.parallelize`` returns on every rank. It runs a
:class:`fairscale.runtime.program.RankProgram` that the face compiled (``fairscale.build``:
capture at the microbatch shape → ``passes.compile_rank``); the runtime never captures, compiles
or renders. Building one:

1. make the program's device current and bind the pp × dp × tp mesh (``fairscale.runtime.mesh``);
2. wrap each stage graph's local tensors in a data-parallel-aware optimizer;
3. run steps through the pipeline executor (one stage and no P2P when pp = 1).

Every rank passes the same **global** batch; each takes its dp slice along dim 0 and copies it to
its device without blocking, and each pipeline stage reads the batch inputs it needs (labels on
the last stage). Losses returned are means over the global batch, identical on every rank.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Iterator, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from fairscale.runtime import engine_checkpoint
from fairscale.runtime.batch_check import check_same_batch
from fairscale.runtime.batch_form import batch_chunks, positional_batch
from fairscale.runtime.clip_guard import guard_clip_grad_norm
from fairscale.runtime.data_parallel import local_slice, rank_slice
from fairscale.runtime.device import enable_tf32, to_device, use_device
from fairscale.runtime.memory_report import ActivationMeter, MemoryReport, measure_memory, step_peaks
from fairscale.runtime.mesh import RankMesh, build_mesh, release_mesh
from fairscale.runtime.modes import ModeError, all_eval, mode_change
from fairscale.runtime.frozen import check_trainable
from fairscale.runtime.gather import collect_on_rank0, gather_into
from fairscale.runtime.grad_none_guard import watch_cleared
from fairscale.runtime.model_guard import guard_model, mark_stale, using_models
from fairscale.runtime.model_owners import NotCopied, refuse_behind
from fairscale.runtime.optim_groups import OptimizerGroups, optimizer_parts
from fairscale.runtime.optim import DataParallelOptimizer, clip_coefficient, merge_grad_norm_parts, reduce_grad_norm
from fairscale.runtime.pipeline import PipelineExecutor
from fairscale.runtime.pipeline_io import split_microbatches
from fairscale.runtime.program import RankProgram
from fairscale.runtime.stage_optimizers import StageOptimizers, optimizer_origin
from fairscale.runtime.tp_random import draws_random, share_random_state
from fairscale.runtime.user_optimizer import note_gradients
from fairscale.runtime.watchdog import collective_call
from fairscale.runtime.state import full_grads as _full_grads
from fairscale.runtime.state_hooks import apply_state_dict_hooks
from fairscale.runtime.state_stream import iter_full_state
from passes.loss_count import piece_weights
from passes.ops import comm
from passes.ops.dp_ops import cast_mark, release_casts
from passes.ops.fsdp_retain import regather_on_backward
from passes.ops.ep_ops import scale_grad
from passes.ops.flight import RECORDER
from passes.ops.gauge import UNSHARD as _UNSHARD

__all__ = ["ParallelModule", "OptimizerSpec"]

OptimizerSpec = Union[Callable[..., torch.optim.Optimizer], OptimizerGroups]
"""An optimizer class or a ``functools.partial`` of one with its options, e.g.
``functools.partial(torch.optim.AdamW, lr=3e-4)``, or the groups of an optimizer the user built
over the model (:class:`fairscale.runtime.optim_groups.OptimizerGroups`). Sharded data-parallel
kinds construct it over this rank's shards."""


def _on_mesh(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a ``ParallelModule`` method with its mesh's groups active (``passes.ops.groups``)."""
    @functools.wraps(method)
    def run(self: ParallelModule, *args: Any, **kwargs: Any) -> Any:
        if self.retired:
            raise RuntimeError(self.retired)
        refuse_behind(self, method.__name__)  # built from a model behind another module (runtime.model_owners)
        mark = cast_mark()
        try:
            with self.mesh.groups.active(), using_models():
                return method(self, *args, **kwargs)
        finally:
            release_casts(mark)  # a data-parallel bucket's 16-bit copies last one call (passes.ops.dp_ops)
    return run


class ParallelModule(NotCopied):
    """This rank's part of a model trained under ``plan``. Build it with ``fairscale.parallelize``.

    Two ways to train:

    * ``loss = pm.train_step(batch)``: forward, backward (through the pipeline schedule) and the
      optimizer step. Works for every plan; use it when pp > 1 or microbatches > 1.
      ``pm.train_step(batch, clip_norm=1.0)`` clips the global gradient norm first
      (``pm.last_grad_norm`` is the norm before clipping).
    * ``loss = pm(batch); loss.backward(); pm.optimizer.step(); pm.optimizer.zero_grad()``:
      the ordinary PyTorch loop, for plans with pp = 1 and one microbatch (gradients are
      synchronized by the collectives in the graph during ``backward``); call
      ``pm.clip_grad_norm_(max_norm)`` before the step to clip.
    """

    def __init__(self, program: RankProgram, *, optimizer: OptimizerSpec | None = None, tf32: bool = True) -> None:
        if not isinstance(program, RankProgram):
            raise TypeError("ParallelModule runs a compiled RankProgram; build one with "
                            "fairscale.parallelize(model, example_inputs=batch, plan=plan) (or, without "
                            "validating the plan, fairscale.build.build_module(model, plan, example_inputs=batch))")
        if not dist.is_initialized():
            raise RuntimeError("a ParallelModule runs on launched ranks: call fairscale.parallelize inside "
                               "fairscale.launch(fn, devices=N), `python -m fairscale run`, or torchrun")
        guard_clip_grad_norm(self)  # torch.nn.utils.clip_grad_norm_(pm.parameters()) clips by the global norm
        self.rank_program = program
        """What the face compiled for this rank (:class:`fairscale.runtime.program.RankProgram`)."""
        self.optimizer_spec = optimizer
        """The optimizer as ``parallelize`` took it (``fairscale.switch_plan`` builds the next module with it)."""
        self.tf32_requested = tf32
        """The ``tf32`` argument (``self.tf32`` says whether TF32 is on)."""
        self.retired: str = ""
        """Why this module no longer runs (``fairscale.switch_plan`` moved its state to another module); empty while it runs."""
        self.device: torch.device = program.device
        """Where this rank computes: its shards, activations and collectives (see ``fairscale.runtime.device``)."""
        use_device(self.device)
        self.tf32 = enable_tf32(self.device) if tf32 else False
        self.plan = program.plan
        m = self.plan.mesh
        self.mesh: RankMesh
        self.mesh, self.device_mesh = build_mesh(m.pp, m.dp, m.tp, ep=m.ep, device_type=self.device.type)
        with self.mesh.groups.active():
            self._start(program, optimizer)

    def _start(self, program: RankProgram, optimizer: OptimizerSpec | None) -> None:
        if self.mesh.coords() != program.coords:
            raise ValueError(f"this rank is at (pp, dp, tp) = {self.mesh.coords()} of the mesh, but its program was "
                             f"compiled for {program.coords}: compile the program on the rank that runs it")
        self.global_batch = program.global_batch
        self.microbatch_rows = program.microbatch_rows
        self.schedule = program.schedule
        self.local_stages = program.local_stages
        self.program = program.stages
        """Every stage's boundary specs and tied-weight groups (``passes.program.StagedProgram``)."""
        self.modules = program.modules
        self._token_counter = program.token_counter
        self._evaluator: PipelineExecutor | None = None
        self._eval_modules: dict[int, torch.fx.GraphModule] | None = None
        self.executor = PipelineExecutor(self.program, self.schedule, modules=self.modules, device=self.device)
        self._tp_random = self.mesh.tp > 1 and draws_random(self.modules[s] for s in self.local_stages)
        cls, kwargs = optimizer_parts(optimizer)
        self._optimizers = [DataParallelOptimizer(self.modules[s], cls, **kwargs) for s in self.local_stages]
        self.optimizer = StageOptimizers(self._optimizers, self.mesh.groups, origin=optimizer_origin(
            self.plan, self.mesh.coords(), dist.get_rank(), [o.info.kind for o in self._optimizers]))
        self._grad_norm: torch.Tensor | None = None
        self._batch_checked = False
        self._user_model = program.model  # for its state-dict hooks; the user holds the model
        guard_model(program.model())  # refuses its use while the ranks hold newer weights
        note_gradients(self, program.model())  # a backward's before the call: not the model trained afterwards
        user = program.model
        self.optimizer.register_step_post_hook(lambda *_: mark_stale(user(), "an optimizer step of its ParallelModule"))
        self._peaks: dict[str, float | None] = {}
        self.last_timing: dict[str, float] = {}
        """Host seconds of the last ``train_step`` on this rank: ``step`` (all of it) and ``optimizer``."""
        self.last_waits: list[tuple[str, str, int, int, float]] = []
        """The collective and point-to-point waits of the last ``train_step``, while the flight
        record times them (``RECORDER.timings`` is a list; ``passes.ops.flight``)."""
        self.after_step: list[Callable[[ParallelModule, float], None]] = []
        """Called as ``hook(pm, loss)`` after each ``train_step``, outside the mesh's groups
        (``fairscale.closed_loop`` measures steps and may switch the plan from one)."""
        self.check_report: Any = None
        """``fairscale.check.CheckReport`` when built by ``parallelize(..., check=True)``."""
        self.sync_timing = False
        """Synchronize a CUDA device where ``last_timing`` reads the clock (the closed loop sets it)."""
        self.closed_loop_report: Any = None
        """``fairscale.closed_loop.ClosedLoopReport`` once ``parallelize(..., calibrate=K)`` has measured."""

    @property
    def last_grad_norm(self) -> float | None:
        """Global gradient norm before clipping of the last ``train_step(..., clip_norm=...)``
        (read from the device only when asked for: no host sync in the step)."""
        return None if self._grad_norm is None else float(self._grad_norm)

    # -- training ---------------------------------------------------------------------------------

    def train_step(self, batch: Sequence[Any], *, clip_norm: float | None = None,
                   measure_memory: bool = False) -> float:
        """One optimizer step on the global ``batch``; returns its mean loss (same on every rank).

        ``clip_norm``: before the step, scale the gradients so the global 2-norm over the whole
        model is at most ``clip_norm`` (see :meth:`clip_grad_norm_`); the norm before clipping is
        kept in ``pm.last_grad_norm``.
        ``measure_memory``: also record the step's peak of saved activations (a hook on every
        tensor autograd saves: slower) for :meth:`memory_report`.
        """
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"clip_norm = {clip_norm!r}; it must be a positive number (or None for no clipping)")
        change = self._mode_change()
        if change is not None:
            raise ModeError(f"pm.train_step runs the mode its graphs were compiled in, and {change}: set the mode back "
                            "(model.train() or model.eval()) before training, or set it before fairscale.parallelize; "
                            "validate with pm.evaluate(batch), or model.eval() and pm(*batch) under torch.no_grad()")
        check_trainable(self._user_model(), self.rank_program.trainable, "pm.train_step")
        loss = self._step(batch, clip_norm=clip_norm, measure_memory=measure_memory)
        with using_models():  # outside the mesh's groups: a hook may switch the plan
            for hook in list(self.after_step):
                hook(self, loss)
        return loss

    @_on_mesh
    def _step(self, batch: Sequence[Any], *, clip_norm: float | None, measure_memory: bool) -> float:
        start, batch = self._clock(), self._batch(batch, "pm.train_step")
        mark = len(RECORDER.timings) if RECORDER.timings is not None else 0
        self.optimizer.zero_grad(set_to_none=True)
        if self._tp_random:  # replicated dropouts draw alike on the tp ranks (runtime.tp_random)
            share_random_state(self.device)
        base = step_peaks(self.device)
        if measure_memory:
            with ActivationMeter(self._stage_states()) as meter:
                loss = self.executor.step(self._local(batch), weights=self._weights(batch))  # mean over pp and dp
            self._peaks = {"activations": float(meter.peak)}
        else:
            loss = self.executor.step(self._local(batch), weights=self._weights(batch))
            self._peaks = {}
        self._peaks["buffers"] = float(_UNSHARD.peak - base)
        if clip_norm is not None:
            self._grad_norm = self.clip_grad_norm_(clip_norm)
        before_optimizer = self._clock()
        self.optimizer.step()
        end = self._clock()
        self.last_timing = {"step": end - start, "optimizer": end - before_optimizer}
        self.last_waits = RECORDER.timings[mark:] if RECORDER.timings is not None else []
        if measure_memory and self.device.type == "cuda":  # after the step, which allocates the optimizer state
            self._peaks["device_peak"] = float(torch.cuda.max_memory_allocated(self.device))
        return loss

    @_on_mesh
    @collective_call("pm.evaluate(batch)")
    def evaluate(self, batch: Sequence[Any]) -> float:
        """The mean loss of the global ``batch`` with the model in eval mode (dropout off, batch
        norm on its running statistics), forward only, nothing updated; the same on every rank,
        as ``model.eval(); loss`` in one process on the weights trained so far. Collective. The
        batch has the training batch's size. Raises ``EvalModeError`` for a model whose code
        branches on ``self.training`` (:mod:`fairscale.eval_mode`)."""
        if self._evaluator is None:
            self._evaluator = PipelineExecutor(self.program, self.schedule, modules=self._eval_graphs(),
                                               device=self.device)
        batch = self._batch(batch, "pm.evaluate")
        return self._evaluator.eval_step(self._local(batch), weights=self._weights(batch))

    def _eval_graphs(self) -> dict[int, torch.fx.GraphModule]:
        """This rank's stage graphs rewritten to eval mode (``fairscale.eval_mode``), made once."""
        if self._eval_modules is None:
            program = self.rank_program
            if program.eval_modules is None:
                raise RuntimeError("this module was compiled without an eval-mode rewrite; build it with "
                                   "fairscale.parallelize (or fairscale.build.build_module)")
            self._eval_modules = program.eval_modules(program, self.modules)
        return self._eval_modules

    def _mode_change(self) -> str | None:
        """How the user's model's train/eval modes differ from the compiled ones (``runtime.modes``)."""
        model = self._user_model()
        return None if model is None else mode_change(model, self.rank_program.modes)

    def _weights(self, batch: Sequence[Any], microbatches: int | None = None) -> list[float] | None:
        """Each of this rank's microbatches' weight in the step's loss when the loss is a token
        mean whose pieces count different numbers of labels (``passes.loss_weights``): ``dp * n_i
        / N``, ``n_i`` the piece's labels not ignored and ``N`` the global batch's; None (the
        plain mean, ``1 / microbatches``) when every piece counts the same. Every rank holds the
        global batch, so each counts all pieces itself, without communication, and every rank
        raises alike when a token mean inside a larger loss meets pieces that count differently."""
        counter = self._token_counter
        m = self.schedule.microbatches if microbatches is None else microbatches
        dp = self.mesh.dp
        if counter is None or dp * m == 1:
            return None
        split_microbatches(local_slice(batch, self.mesh.dp_index, dp), m, self.program, self.local_stages)  # shapes first
        flat = counter.count_all([tuple(part) for d in range(dp)
                                  for part in batch_chunks(local_slice(batch, d, dp), m)])
        return piece_weights(counter, [flat[d * m:(d + 1) * m] for d in range(dp)], self.mesh.dp_index)

    def _clock(self) -> float:
        if self.sync_timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _batch(self, batch: Any, call: str, named: dict[str, Any] | None = None) -> tuple[Any, ...]:
        """The global ``batch`` in the positional form the graphs run (``runtime.batch_form``: a
        dict by the example's names). The first is checked to be the same on every rank."""
        batch = positional_batch(batch, call, named, getattr(self.rank_program.example_inputs, "batch_keys", None))
        if not self._batch_checked:
            check_same_batch(batch, device=self.device)
            self._batch_checked = True
        return batch

    def _local(self, batch: tuple[Any, ...]) -> tuple[Any, ...]:
        """This rank's dp slice of the global ``batch``, on its device (copied without blocking)."""
        return to_device(rank_slice(batch, self.mesh.dp_index, self.mesh.dp), self.device)

    @_on_mesh
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Scale this rank's gradients so the norm over the FULL model's gradients is at most
        ``max_norm``; return the norm before clipping (the same on every rank). Collective.

        ``torch.nn.utils.clip_grad_norm_`` semantics (same 1e-6 epsilon) on the user's model: each
        parameter element counts once. Slices (``TensorShard``) add over their own axis (tp, ep,
        ...), data-parallel shards over dp, pipeline stages over pp; whole tensors (replicas on tp
        or dp ranks) count once, and a weight tied across stages counts only on its first stage
        (the pipeline has already given every copy the summed gradient). Use it in the manual loop
        (``loss.backward(); pm.clip_grad_norm_(1.0); pm.optimizer.step()``); ``train_step``
        calls it for ``clip_norm``. ``error_if_nonfinite``: raise, on every rank, before scaling
        anything when the norm is inf or nan, as torch's does.
        """
        parts = merge_grad_norm_parts(
            (opt.grad_norm_parts(norm_type, skip_keys=self._tied_copies(s))
             for s, opt in zip(self.local_stages, self._optimizers)), norm_type)
        total = reduce_grad_norm(parts, norm_type, reduce_axes=("pp",))
        if error_if_nonfinite and not bool(torch.isfinite(total)):  # the same total on every rank
            raise RuntimeError(f"The total norm of order {norm_type} for the ParallelModule's gradients is "
                               "non-finite, so it cannot be clipped. To disable this error and scale the "
                               "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
        coef = clip_coefficient(total, max_norm)
        for opt in self._optimizers:
            opt.scale_grads_(coef)
        return total

    def _tied_copies(self, stage: int) -> set[str]:
        """Keys of ``stage``'s copies of weights whose first holder is an earlier stage."""
        program = self.program
        later = [k for k in program.shared_keys(stage) if min(program.shared[program.canonical(k)]) != stage]
        return {name for k in later for name in program.aliases.get(k, [k])}

    @_on_mesh
    def __call__(self, *batch: Any, **named: Any) -> torch.Tensor:
        """This rank's loss on its dp slice of the global ``batch``, with autograd (pp = 1 only)."""
        batch = self._batch(batch, "pm(*batch)", named)
        if self.plan.mesh.pp > 1 or self.plan.schedule.microbatches > 1:
            raise RuntimeError(
                f"pm(batch) runs plans with pp = 1 and one microbatch; this plan has pp={self.plan.mesh.pp} and "
                f"{self.plan.schedule.microbatches} microbatches, whose forward and backward the pipeline "
                "schedule interleaves: use pm.train_step(batch) to train, and pm.evaluate(batch) for a loss without "
                "training (validation: the global batch's mean loss in eval mode)")
        modules, change = self.modules, self._mode_change()
        if change is not None:
            model = self._user_model()
            if torch.is_grad_enabled() or model is None or not all_eval(model):
                raise ModeError(f"pm(batch) runs the mode its graphs were compiled in, and {change}: after "
                                "model.eval(), call pm(*batch) under torch.no_grad() (it then runs in eval mode) or "
                                "use pm.evaluate(batch); set the mode back (model.train()) before training")
            modules = self._eval_graphs()
        if torch.is_grad_enabled():
            check_trainable(self._user_model(), self.rank_program.trainable, "pm(batch)")
        weights = self._weights(batch, microbatches=1)
        if self._tp_random:
            share_random_state(self.device)
        (micro,) = split_microbatches(self._local(batch), 1, self.program, self.local_stages)
        out = modules[0](*(micro[i] for i in self.program.stages[0].batch_inputs))  # inputs it reads (not None's)
        loss = out[0] if isinstance(out, (tuple, list)) else out  # a stage graph returns (loss,)
        if self._optimizers[0].info.units:  # a second backward (retain_graph=True) finds them gathered
            regather_on_backward(loss, self._optimizers[0].info.units)
        # A token mean over dp slices that count different labels: this rank's gradient weighs
        # dp * n_r / N (the average over dp is then the batch's token mean); the value stays this
        # rank's own mean, as torch DDP's would.
        watch_cleared(self, loss)  # p.grad = None on the model's parameters clears pm's (runtime.grad_none_guard)
        return loss if weights is None else scale_grad(loss, weights[0])

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's trainable local tensors (slices and shards), as the optimizer sees them."""
        for opt in self._optimizers:
            yield from opt.params

    # -- state ------------------------------------------------------------------------------------

    @_on_mesh
    @collective_call("pm.state_dict()")
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The user's full state_dict (same keys as ``model.state_dict()``), on global rank 0 only, in
        host memory; other ranks get ``{}``. Collective: every rank must call it.

        Gathered one tensor (or ZeRO bucket, or FSDP unit) at a time: each stage's first rank
        (dp 0, tp 0) sends its stage's tensors to rank 0 one by one, so no device ever holds more
        than its own shards plus one gathered unit, and only rank 0's host holds the whole model.
        The model's own state-dict hooks run on the result (``fairscale.runtime.state_hooks``), so
        a model that saves a fused weight as parts gets the parts, as ``model.state_dict()`` would."""
        out = self._on_rank0(self._full_tensors())
        model = self._user_model()
        return apply_state_dict_hooks(model, out) if out and model is not None else out

    @_on_mesh
    @collective_call("pm.full_grads()")
    def full_grads(self) -> dict[str, torch.Tensor]:
        """The full gradients of the last backward (after ``train_step``, or ``loss.backward()``
        in the plain loop), in the user's keys (``model.named_parameters()`` names, and every name
        of a tied weight), on global rank 0 only; other ranks get ``{}``. Tensors without a
        gradient are absent. Collective. ``fairscale.check`` compares them with one process."""
        grads = ((k, g) for s in self.local_stages
                 for k, g in _full_grads(self.modules[s], aliases=self.rank_program.tied, rank0_only=False,
                                               cpu=False).items())
        return self._on_rank0(([k], g) for k, g in grads)

    def _on_rank0(self, mine: Iterator[tuple[list[str], torch.Tensor]]) -> dict[str, torch.Tensor]:
        return collect_on_rank0(self.mesh, self.device, mine)

    @_on_mesh
    @collective_call("pm.gather_into(model)")
    def gather_into(self, model: nn.Module) -> None:
        """Copy the trained weights and buffers into ``model`` (the model given to ``parallelize``, or
        one built the same way) on every rank, so ``model.save_pretrained``, ``model.state_dict()`` or
        ``model.generate`` see them; until then the parallelized model refuses its forward and
        ``state_dict()`` (``fairscale.runtime.model_guard``). Collective: every rank calls it."""
        gather_into(model, self._on_rank0(self._full_tensors()), self.device)

    def _full_tensors(self) -> Iterator[tuple[list[str], torch.Tensor]]:
        """(user names, full tensor on this rank's device) for every tensor of this rank's stages, one
        at a time (``fairscale.runtime.state_stream``). Collective over each stage's dp and tp groups."""
        for s in self.local_stages:
            yield from iter_full_state(self.modules[s], aliases=self.rank_program.tied)

    @_on_mesh
    @collective_call("pm.save_checkpoint(path)")
    def save_checkpoint(self, path: str) -> None:
        """Save model and optimizer state so any plan can resume it (``fairscale.runtime.engine_checkpoint``)."""
        engine_checkpoint.save(path, self._stage_states(), mesh=self.mesh, tied=self.rank_program.tied)

    @_on_mesh
    @collective_call("pm.load_checkpoint(path)")
    def load_checkpoint(self, path: str) -> None:
        """Resume from a checkpoint saved under this or any other plan of the same model."""
        engine_checkpoint.load(path, self._stage_states(), model=self._user_model())
        mark_stale(self._user_model(), "pm.load_checkpoint")

    def _stage_states(self) -> list[tuple[torch.fx.GraphModule, DataParallelOptimizer]]:
        return [(self.modules[s], opt) for s, opt in zip(self.local_stages, self._optimizers)]

    def become(self, other: ParallelModule) -> None:
        """Take over ``other``'s program, mesh and state, keeping this module's ``after_step`` hooks
        (``other`` came from ``fairscale.switch_plan(self, ...)``), so references the user holds to
        this module train under the new plan; ``other`` is not used afterwards."""
        hooks = self.after_step
        self.__dict__.update(other.__dict__)
        self.after_step = hooks

    def retire(self, why: str) -> None:
        """Release this rank's graphs, shards, optimizer state and process groups
        (``fairscale.runtime.mesh.release_mesh``); every later call raises ``why``. Collective."""
        self.retired = why
        release_mesh(self.mesh, self.device_mesh)
        self.modules = {}
        self._eval_modules = None
        self._optimizers = []
        self.optimizer = StageOptimizers([], self.mesh.groups)
        self.executor = None  # type: ignore[assignment]
        self._evaluator = None

    def close(self) -> None:
        """Release what this module holds on this rank (its graphs, shards, optimizer state and
        process groups) when training with it is done and the process goes on: each gloo group
        keeps worker threads that wake about every 10 ms, which later work in the process pays
        for. Later calls raise. Idempotent. Collective: every rank calls it alike."""
        if not self.retired:
            self.retire("this ParallelModule was closed (pm.close()); build another with fairscale.parallelize")

    def report(self) -> str:
        """The plan's text report (stages, memory, predicted time, collectives), as the face that
        compiled this rank rendered it (``fairscale.report.text.render_report``)."""
        return self.rank_program.report

    @_on_mesh
    def memory_report(self) -> MemoryReport:
        """This rank's memory by category (parameters, gradients, optimizer, activations, buffers),
        measured against the planner's prediction. On CPU from the runtime's own accounting of the
        tensors it holds (call it after a step: gradients and optimizer state exist from the first
        one; activations are measured in a step run with ``measure_memory=True``); on CUDA also the
        allocator's peak of that step (``torch.cuda.max_memory_allocated``) against the predicted
        total. See :mod:`fairscale.runtime.memory_report`."""
        return measure_memory(self._stage_states(), predicted=self.rank_program.predicted_memory,
                              device=self.device, peaks=self._peaks)

    @property
    def comm_counter(self) -> comm.CommCounter:
        """Bytes each collective of this module moved on this rank (ring volumes), by kind and axis;
        ``fairscale.comm_counter`` counts every collective of the process."""
        if self.mesh.groups.counter is None:
            self.mesh.groups.counter = comm.CommCounter()
        return self.mesh.groups.counter

    def comm_summary(self) -> str:
        """Bytes each collective of this module moved on this rank (ring volumes) since its counter
        (``pm.comm_counter``) was reset."""
        return self.comm_counter.summary()

