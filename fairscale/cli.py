"""fairscale: make, check and show parallelization plans for a model built by an importable factory.

    fairscale plan mypkg.models:build_gpt --devices 8 -o plan.json
    fairscale validate plan.json                 # the factory is recorded in the plan
    fairscale report plan.json mypkg.models:build_gpt
    fairscale check mypkg.models:build_gpt --devices 8 [--plan plan.json]   # one step vs one process
    fairscale calibrate [--devices 8]            # this machine's GPU, else CPU ranks (cached; first plan does it)
    fairscale diff a.json b.json                 # why one plan is faster, per term and per stage
    fairscale what-if plan.json --cluster h100-sxm-80gb --nodes 64   # the plan on other hardware
    python -m fairscale ...                      # the same

A FACTORY is ``pkg.module:function`` (or ``path/to/file.py:function``) naming a function that takes
no arguments and returns one of

* a ``fairscale.testing.models.Case`` (model, ``make_batch(step, batch_size)``, ``loss_fn``);
* ``(model, example_inputs)``: the model returns its loss (e.g. a Hugging Face model given labels);
* ``(model, example_inputs, loss_fn)``: the loss is ``loss_fn(model(inputs[0]), *inputs[1:])``.

Exit codes: 0 success, 1 invalid plan (every problem is printed; also a plan the passes cannot
compile, and for ``check`` a run that differs from one process or crashed), 2 usage error (bad
arguments, a factory that cannot be imported or run, a missing file, an output file that exists
without --force, a model ``check`` cannot compare).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from planner.api import resolve_cluster
from planner.capture import CaptureError
from planner.gc_budget import fewer_collections
from planner.cluster import Cluster
from planner.graph import ModelGraph
from planner.plan import Plan, PlanError
from planner.search import cost_plan
from planner.validate import device_count, validate_plan

__all__ = ["main", "render_report", "load_factory", "UsageError"]

from fairscale.api import captured, known_dtype, planning_dtype, search_graph  # noqa: E402 - the face's one search
from fairscale.cli_factory import (CAPTURE_BATCH, Loaded, UsageError, load_factory,  # noqa: E402, F401 - re-exported
                                   recorded_factory)
from fairscale.cli_whatif import add_commands as add_whatif_commands  # noqa: E402
from fairscale.compile_check import checker_for  # noqa: E402
from fairscale.runtime.calibrate_gpu import calibrate_gpu_and_cache  # noqa: E402
from fairscale.runtime.calibration_cache import calibrate_and_cache, cpu_cluster  # noqa: E402
from fairscale.calibrate_host import measure_runtime_host  # noqa: E402
from fairscale.report.text import render_report  # noqa: E402 - re-exported for callers of the CLI module

def _capture_loaded(spec: str, out: Callable[[str], None], dtype: str = "fp32") -> tuple[Loaded, ModelGraph]:
    loaded = load_factory(spec)
    start = time.perf_counter()
    try:  # traced as plans of compute dtype ``dtype`` run the model (fairscale.api.captured)
        graph = captured(loaded.model, loaded.batch, loss_fn=loaded.loss_fn, dtype=dtype)
    except CaptureError as exc:
        raise UsageError(f"FACTORY {spec!r}: the model could not be captured: {exc}") from exc
    out(f"captured {graph.model_class} from {spec}: {graph.num_parameters:,} parameters, {len(graph.layers)} layers "
        f"({time.perf_counter() - start:.1f} s)")
    return loaded, graph


# --- clusters ----------------------------------------------------------------------------------


def _cluster(args: argparse.Namespace, *, devices_mean_cpu: bool = True) -> Cluster | None:
    """The cluster named by --cluster/--nodes/--devices (``planner.api.resolve_cluster``: a preset
    of K nodes, or of N devices with a partial last node; --devices alone: this machine's GPUs, or
    N CPU ranks), or None when none was named (or only --devices, with ``devices_mean_cpu`` off)."""
    if args.nodes is not None and args.cluster is None:
        raise UsageError("--nodes needs --cluster PRESET (a CPU run is one node: use --devices N)")
    if args.devices is not None and args.devices < 1:
        raise UsageError(f"--devices must be at least 1, got {args.devices}")
    if args.cluster is None and (args.devices is None or not devices_mean_cpu):
        return None
    if args.cluster is None and torch.cuda.device_count() == 0:  # CPU ranks: this machine, measured once
        return cpu_cluster(args.devices, runtime_host=measure_runtime_host)
    spec = args.cluster if args.nodes is None else f"{args.cluster}:{args.nodes}"
    try:
        return resolve_cluster(spec, devices=args.devices)
    except ValueError as exc:
        raise UsageError(f"--cluster: {exc}" if args.cluster else
                         f"--devices: {exc}; to plan for another machine name it with --cluster PRESET") from exc


# --- commands ----------------------------------------------------------------------------------


def _cmd_plan(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    if cluster is None:
        raise UsageError("plan needs the devices: give --devices N (CPU ranks here) or --cluster PRESET --nodes K")
    if args.output is not None and Path(args.output).exists() and not args.force:
        raise UsageError(f"{args.output} exists; pass --force to replace it")
    to_stdout = args.output is None  # then everything else goes to stderr, so that the JSON can be piped
    out: Callable[[str], None] = (lambda s: print(s, file=sys.stderr)) if to_stdout else print
    if args.global_batch is not None and args.global_batch < 1:
        raise UsageError(f"--global-batch must be at least 1, got {args.global_batch}")
    constraints = _constraints(args.constraints)
    loaded, graph = _capture_loaded(args.factory, out, planning_dtype(cluster, constraints, args.dtype))
    global_batch = args.global_batch or (cluster.devices if loaded.make_batch else graph.batch_size)  # --help
    # the same search, rules and cache as fairscale.search / fairscale.plan, and the compile check
    result = search_graph(graph, cluster, global_batch=global_batch, constraints=constraints, dtype=args.dtype,
                          compiles=checker_for(loaded.model, loaded.batch, loss_fn=loaded.loss_fn, graph=graph),
                          check_runners_up=False)  # the winner is what it writes; as fairscale.plan
    plan = copy.deepcopy(result.plan)
    out(result.table())
    plan.model.factory = args.factory
    plan.schedule.global_batch = global_batch
    # Our own output must be valid; if the search returned something invalid, that is its bug, said so.
    validate_plan(plan, graph, cluster, source="the plan planner.search returned", runnable=False)
    if to_stdout:
        sys.stdout.write(plan.to_json())
        return 0
    path = plan.save(args.output, overwrite=args.force)
    out(f"wrote {path}")
    out(render_report(plan, graph))
    return 0


def _constraints(text: str | None) -> dict[str, Any] | None:
    """--constraints: inline JSON (``'{"mesh": {"tp": 2}}'``) or a file holding it."""
    if text is None:
        return None
    source = "--constraints"
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise UsageError(f"--constraints {text!r}: neither a JSON object nor a file")
        source, text = str(path), path.read_text(encoding="utf-8-sig")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{source}:{exc.lineno}:{exc.colno}: not valid JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{source}: expected a JSON object (a partial plan), got {type(data).__name__}")
    return data


def _load_plan_and_model(args: argparse.Namespace) -> tuple[Plan, ModelGraph | None, Cluster | None, Loaded | None]:
    path = Path(args.plan)
    if not path.is_file():
        raise UsageError(f"{path}: no such file" if not path.exists() else f"{path} is not a file")
    plan, args.schema_problems = Plan.read(path)  # every problem is reported once the model is captured
    factory = args.factory or (plan.model.factory and recorded_factory(plan.model.factory, path))
    loaded: Loaded | None = None
    if factory:
        loaded, graph = _capture_loaded(factory, print, known_dtype(plan.data_parallel.param_dtype))
    else:
        graph = None
        print("no FACTORY given and the plan records none (model.factory): checked the plan without the model; "
              "selectors, layer coverage, tensor dimensions and the fingerprint were not checked")
    # --devices overrides the count to check against; the hardware is --cluster's or the plan's own.
    cluster = _cluster(args, devices_mean_cpu=False)
    if cluster is None and plan.cluster:
        try:
            cluster = Cluster.from_dict(plan.cluster)
        except (ValueError, TypeError, KeyError):
            cluster = None  # device_count still reads a partial record; validate says if none is known
    return plan, graph, cluster, loaded


def _cmd_calibrate(args: argparse.Namespace) -> int:
    if not args.cpu and torch.cuda.device_count() > 0:  # NVML's count: no CUDA context here
        calibrate_gpu_and_cache(out=sys.stdout)
        return 0
    if args.devices is None or args.devices < 2:
        raise UsageError(f"--devices must be at least 2 for CPU ranks (collectives need two ranks; no GPU is visible, "
                         f"or --cpu was given), got {args.devices}")
    calibrate_and_cache(args.devices, out=sys.stdout, runtime_host=measure_runtime_host)
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    plan, graph, cluster, loaded = _load_plan_and_model(args)
    validate_plan(plan, graph, cluster, devices=args.devices, source=args.plan,
                  schema_problems=args.schema_problems)
    _recost(plan, graph, cluster, args)
    _compile_check(plan, loaded, args)
    n = args.devices or device_count(cluster) or device_count(plan.cluster)
    model = f"{graph.model_class} (fingerprint {graph.fingerprint})" if graph is not None else "any model"
    print(f"{args.plan} is valid for {model} on {n if n is not None else 'an unknown number of'} devices")
    print(render_report(plan, graph))
    return 0


def _compile_check(plan: Plan, loaded: Loaded | None, args: argparse.Namespace) -> None:
    """Compile the plan for every rank (needs the model): PlanCompileError, exit 1, if refused."""
    from fairscale.compile_check import validate_compiles

    print("compile check: skipped, no model (give FACTORY)" if loaded is None else validate_compiles(
        plan, loaded.model, loaded.batch, loss_fn=loaded.loss_fn, global_batch=args.global_batch, source=args.plan))


def _cmd_report(args: argparse.Namespace) -> int:
    plan, graph, cluster, _ = _load_plan_and_model(args)
    validate_plan(plan, graph, cluster, devices=args.devices, source=args.plan,
                  schema_problems=args.schema_problems)
    _recost(plan, graph, cluster, args)
    print(render_report(plan, graph))
    return 0


def _recost(plan: Plan, graph: ModelGraph | None, cluster: Cluster | None, args: argparse.Namespace) -> None:
    """Replace ``plan.predicted`` (in memory; the file is never rewritten) by the cost model's figures
    for this model and cluster; raise PlanError if the plan no longer fits in device memory."""
    global_batch = args.global_batch or plan.schedule.global_batch

    def skip(why: str) -> None:
        print(f"predictions: as recorded in the plan, not re-costed: {why}")

    if graph is None:
        return skip("no model to cost (give FACTORY)")
    if cluster is None:
        return skip("the plan records no cluster (give --cluster)")
    if not global_batch:
        return skip("the plan records no global batch (give --global-batch)")
    if cluster.devices < plan.mesh.size:
        return skip(f"the cluster has {cluster.devices} devices, the mesh {plan.mesh.size}")
    try:
        cost = cost_plan(plan, graph, cluster, global_batch=global_batch, validate=False)
    except PlanError as exc:
        return skip("; ".join(exc.problems))
    before = plan.predicted.step_time_s
    plan.predicted = cost.predicted
    was = f" (the file says {before:.4g} s)" if before else ""
    print(f"re-costed on {cluster.devices} × {cluster.device} at global batch {global_batch}: "
          f"{cost.step_time_s:.4g} s/step{was}")
    if not cost.fits:
        worst = max(range(len(cost.memory_bytes)), key=lambda r: cost.memory_bytes[r])
        raise PlanError([f"predicted.memory_gib: pipeline rank {worst} needs {cost.memory_bytes[worst] / 2**30:.2f} "
                         f"GiB, over the {cost.memory_cap / 2**30:.2f} GiB usable per {cluster.device} device; "
                         "shard more (fsdp, larger tp or pp), recompute more layers, or use smaller microbatches"],
                        source=args.plan)


# --- entry point -------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fairscale", description=__doc__.split("\n\n")[0],
        epilog="Exit codes: 0 success, 1 invalid plan (every problem is printed), 2 usage error.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    factory_help = ("pkg.module:function (or file.py:function) returning a fairscale.testing.models.Case, "
                    "(model, example_inputs) or (model, example_inputs, loss_fn)")

    def devices(p: argparse.ArgumentParser, *, required_note: str) -> None:
        p.add_argument("--devices", type=int, metavar="N", help=f"number of devices {required_note}")
        p.add_argument("--cluster", metavar="PRESET", help="a named system, e.g. a100-80gb, h100-sxm-80gb, h200")
        p.add_argument("--nodes", type=int, metavar="K", help="nodes of the --cluster preset (default 1)")

    p = sub.add_parser("plan", help="make a plan for a model", description=(
        "Capture the model and search a plan for the devices (what fairscale.plan does). Prints the plan as "
        "JSON, or writes it to -o and prints its report."))
    p.add_argument("factory", metavar="FACTORY", help=factory_help)
    devices(p, required_note="(CPU ranks on a machine without GPUs); or name a --cluster")
    p.add_argument("--global-batch", type=int, metavar="B", help="samples per optimizer step (default: the example "
                   "batch's rows, as fairscale.plan; N for a factory that makes batches of any size)")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default=None, help=(
        "compute dtype (default auto: mixed precision, bf16 or fp16, on GPUs with fp32 master weights and "
        "gradient reduction; fp32 on CPU ranks)"))
    p.add_argument("--constraints", metavar="JSON", help=(
        "a partial plan the search must keep, inline or a file, e.g. '{\"mesh\": {\"tp\": 2}}'"))
    p.add_argument("-o", "--output", metavar="PATH", help="write the plan here (never over a file without --force)")
    p.add_argument("--force", action="store_true", help="replace the -o file if it exists")
    p.set_defaults(run=_cmd_plan)

    for name, run, what in (
            ("validate", _cmd_validate, "Check a plan against the model and devices; print every problem "
                                        "(exit 1) or the plan's report (exit 0)."),
            ("report", _cmd_report, "Print a plan as a readable table: the mesh and schedule, stages with "
                                    "their layers and parameter counts, per-device memory, predicted step "
                                    "time and collectives per step. Predictions are those the plan holds.")):
        p = sub.add_parser(name, help=what.split(";")[0].split(":")[0].lower(), description=what)
        p.add_argument("plan", metavar="PLAN.json", help="the plan file")
        p.add_argument("factory", metavar="FACTORY", nargs="?",
                       help=factory_help + "; default: the plan's model.factory")
        devices(p, required_note="to check the mesh against (default: the cluster recorded in the plan)")
        p.add_argument("--global-batch", type=int, metavar="B",
                       help="samples per step for re-costing (default: the plan's schedule.global_batch)")
        p.set_defaults(run=run)

    p = sub.add_parser("check", help="run one step of a plan on CPU ranks against one process", description=(
        "Run one training step of a plan (the searched one, or --plan) on N forked CPU ranks and compare "
        "its loss and every gradient with the unparallelized model on the same batch, within float "
        "tolerance (fairscale.numerics). Prints per-loss and per-gradient errors and the first module "
        "whose gradient differs. Exit 0 when they match, 1 when they differ, the plan does not compile, "
        "or it crashed. Dropout modules are turned off in both runs."))
    p.add_argument("factory", metavar="FACTORY", help=factory_help)
    devices(p, required_note="(the CPU ranks the check runs on; --cluster plans for that system instead)")
    p.add_argument("--plan", metavar="PLAN.json", help="check this plan instead of searching one")
    p.add_argument("--global-batch", type=int, metavar="B",
                   help="samples in the checked step (default: the plan's, else N)")
    p.add_argument("--constraints", metavar="JSON", help="a partial plan the search must keep (without --plan)")
    p.set_defaults(run=_cmd_check)

    p = sub.add_parser("calibrate", help="measure this machine's GPU, or its CPU ranks, for the cost model (cached)",
                       description="A visible GPU: its GEMM rates, bandwidth, launch time (a few s); else (or --cpu) "
                                   "N CPU ranks' rates, gloo collectives (20-27 s for 8 ranks on 2 cores). Replaces the cache.")
    p.add_argument("--devices", type=int, metavar="N", help="number of CPU ranks (at least 2; CPU ranks only)")
    p.add_argument("--cpu", action="store_true", help="calibrate CPU ranks even where a GPU is visible")
    p.set_defaults(run=_cmd_calibrate)

    p = sub.add_parser("run", help="run a script on N CPU ranks, as torchrun would", description=(
        "Run SCRIPT on N forked ranks with torch.distributed initialized (gloo on CPU) and RANK, WORLD_SIZE, "
        "LOCAL_RANK set. Arguments after the script are passed to it. A script that trains with "
        "fairscale.train re-plans and resumes from its last checkpoint after a restart."))
    p.add_argument("--devices", type=int, required=True, metavar="N", help="number of ranks")
    p.add_argument("--timeout", type=float, metavar="S", help="wall-clock limit in seconds (default: none; Ctrl-C "
                   "or SIGTERM stop every rank)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K", help="after a failure, start again on the "
                   "devices that are left (a rank that died takes its device), at most K times (default 0)")
    p.add_argument("--checkpoint-every", type=int, metavar="S", help="fairscale.train in the script checkpoints "
                   "every S steps and resumes from the last checkpoint after a restart")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="where fairscale.train checkpoints and resumes (default "
                   "with --max-restarts or --checkpoint-every: a temporary directory, removed on success)")
    p.add_argument("--calibrate", action="store_true", help="close the loop: time the first steps of every "
                   "parallelize in the script, print predicted against measured, refit the cost model, and switch "
                   "live to a plan predicted at least 10%% faster (fairscale.closed_loop)")
    p.add_argument("--calibrate-steps", type=int, metavar="K", help="steps to time after one warm-up step "
                   "(default 5; implies --calibrate)")
    p.add_argument("script", metavar="SCRIPT.py")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...")
    p.set_defaults(run=_cmd_run)

    p = sub.add_parser("demo", help="plan, report and train a small GPT on CPU ranks", add_help=False,
                       description="See `python -m fairscale demo --help`.")
    p.add_argument("demo_args", nargs=argparse.REMAINDER)
    p.set_defaults(run=_cmd_demo)
    add_whatif_commands(sub, graph_of=lambda spec, dtype: _capture_loaded(spec, print, dtype)[1], cluster_of=_cluster,
                        devices=devices, factory_help=factory_help, usage_error=UsageError)
    return parser


def _cmd_check(args: argparse.Namespace) -> int:
    from fairscale.check import RandomOpsError, check
    from fairscale.runtime.launch import RankFailedError

    cluster = _cluster(args)
    if cluster is None:
        raise UsageError("check needs the devices: give --devices N (the CPU ranks it runs on)")
    plan_path = None
    if args.plan is not None:
        plan_path = Path(args.plan)
        if not plan_path.is_file():
            raise UsageError(f"--plan {plan_path}: no such file")
        if args.constraints is not None:
            raise UsageError("--constraints shapes a search; with --plan nothing is searched: give one of them")
    loaded = load_factory(args.factory)
    gb = args.global_batch or (Plan.load(plan_path).schedule.global_batch if plan_path else 0) or cluster.devices
    if gb < 1:
        raise UsageError(f"--global-batch must be at least 1, got {gb}")
    batch = tuple(loaded.make_batch(0, gb)) if loaded.make_batch is not None else loaded.batch
    print(f"checking {type(loaded.model).__name__} from {args.factory} on {cluster.devices} CPU ranks "
          f"({'plan ' + str(plan_path) if plan_path else 'the searched plan'}, global batch {gb})")
    try:
        report = check(loaded.model, batch, devices=cluster.devices, loss_fn=loaded.loss_fn, plan=plan_path,
                       cluster=cluster, global_batch=gb, constraints=_constraints(args.constraints))
    except RandomOpsError as exc:
        raise UsageError(str(exc)) from exc
    except RankFailedError as exc:
        print(f"fairscale check: the plan crashed on the ranks after launch (a fairscale bug; please report it):\n{exc}",
              file=sys.stderr)
        return 1
    print(report.describe())
    return 0 if report.ok else 1


def _cmd_run(args: argparse.Namespace) -> int:
    from fairscale.closed_loop import DEFAULT_STEPS
    from fairscale.runtime.run_cli import run_script

    steps = args.calibrate_steps if args.calibrate_steps is not None else (DEFAULT_STEPS if args.calibrate else None)
    return run_script(args.script, args.devices, args.script_args, timeout_s=args.timeout,
                      max_restarts=args.max_restarts, checkpoint_dir=args.checkpoint_dir,
                      checkpoint_every=args.checkpoint_every, calibrate_steps=steps)


def _cmd_demo(args: argparse.Namespace) -> int:
    from fairscale.demo import main as demo_main

    return demo_main(args.demo_args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fairscale`` command line; return the exit code."""
    with fewer_collections():  # the user's factory builds the model in here too (planner.gc_budget)
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse's usage errors (2) and --help (0), as a return value
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return int(args.run(args))
    except UsageError as exc:
        print(f"fairscale {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except PlanError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except FileExistsError as exc:  # -o raced with another writer
        print(f"fairscale {args.command}: error: {exc}", file=sys.stderr)
        return 2
