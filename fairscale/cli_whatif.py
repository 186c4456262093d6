"""``fairscale diff`` and ``fairscale what-if`` (``fairscale.whatif`` on the command line).

``fairscale.cli`` registers them with :func:`add_commands`, handing in how it loads a model from a
FACTORY and reads --cluster/--nodes/--devices, so both commands read models and clusters exactly
as ``plan`` and ``validate`` do.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from pathlib import Path

from fairscale.api import known_dtype
from fairscale.cli_factory import recorded_factory
from fairscale.whatif import diff_plans, what_if
from planner.cluster import Cluster
from planner.graph import ModelGraph
from planner.plan import Plan, PlanError

__all__ = ["add_commands"]

GraphOf = Callable[[str, str], ModelGraph]
"""(factory spec, compute dtype) -> the model's capture traced as plans of that dtype run it."""
ClusterOf = Callable[[argparse.Namespace], "Cluster | None"]


def add_commands(sub: argparse._SubParsersAction, *, graph_of: GraphOf, cluster_of: ClusterOf,
                 devices: Callable[..., None], factory_help: str, usage_error: type[Exception]) -> None:
    """Add ``diff`` and ``what-if`` to the ``fairscale`` parser's subcommands."""
    p = sub.add_parser("diff", help="say why one plan is faster than another, per term and per stage", description=(
        "Re-cost two plans for the same model on the same cluster and print where their step times differ: "
        "compute, recompute, each collective, the bubble, the optimizer, memory headroom, per stage."))
    p.add_argument("plan_a", metavar="A.json")
    p.add_argument("plan_b", metavar="B.json")
    p.add_argument("factory", metavar="FACTORY", nargs="?", help=factory_help + " (default: A's model.factory)")
    devices(p, required_note="(default: the cluster A records)")
    p.add_argument("--global-batch", type=int, metavar="B", help="samples per step (default: each plan's own)")
    p.add_argument("--html", metavar="OUT.html", help="also write both plans side by side (per term, per stage, "
                   "memory, and each plan's mesh, memory and timeline pictures) to an offline HTML page")
    p.set_defaults(run=functools.partial(_cmd_diff, graph_of=graph_of, cluster_of=cluster_of, usage=usage_error))

    p = sub.add_parser("what-if", help="re-cost a plan on other hardware and compare with the search there",
                       description=("Re-cost a plan on another cluster (its data parallelism scaled to the devices), "
                                    "say whether it fits and how fast it is, and what the search would pick there."))
    p.add_argument("plan", metavar="PLAN.json")
    p.add_argument("factory", metavar="FACTORY", nargs="?", help=factory_help + " (default: the plan's model.factory)")
    devices(p, required_note="(with --cluster: a partial last node is allowed)")
    p.add_argument("--global-batch", type=int, metavar="B", help="samples per step (default: the plan's own)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="compute dtype to cost it in")
    p.add_argument("--no-search", action="store_true", help="only re-cost the plan")
    p.set_defaults(run=functools.partial(_cmd_what_if, graph_of=graph_of, cluster_of=cluster_of, usage=usage_error))


def _read(path: str, usage: type[Exception]) -> Plan:
    if not Path(path).is_file():
        raise usage(f"{path}: no such file")
    plan, problems = Plan.read(path)
    if problems:
        raise PlanError(problems, source=path)
    return plan


def _graph(plan: Plan, factory: str | None, graph_of: GraphOf, usage: type[Exception], what: str,
           dtype: str | None = None) -> ModelGraph:
    """The capture to cost ``plan`` from: traced in ``dtype`` (default: the plan's compute dtype)."""
    spec = factory or plan.model.factory
    if not spec:
        raise usage(f"{what} records no model.factory; give FACTORY (pkg.module:function) to cost it")
    return graph_of(factory or recorded_factory(spec, what), dtype or known_dtype(plan.data_parallel.param_dtype))


def _cmd_diff(args: argparse.Namespace, *, graph_of: GraphOf, cluster_of: ClusterOf, usage: type[Exception]) -> int:
    a, b = _read(args.plan_a, usage), _read(args.plan_b, usage)
    graph = _graph(a, args.factory, graph_of, usage, args.plan_a)  # each plan from the trace in its own dtype
    same_dtype = known_dtype(b.data_parallel.param_dtype) == known_dtype(a.data_parallel.param_dtype)
    graph_b = None if same_dtype else _graph(b, args.factory, graph_of, usage, args.plan_b)
    cluster = cluster_of(args) or (Cluster.from_dict(a.cluster) if a.cluster else None)
    if cluster is None:
        raise usage(f"{args.plan_a} records no cluster; give --cluster PRESET (and --nodes/--devices)")
    names = (Path(args.plan_a).name, Path(args.plan_b).name)
    d = diff_plans(a, b, graph, cluster, global_batch=args.global_batch, names=names, graph_b=graph_b)
    print(d.text())
    if args.html:
        from fairscale.report.compare import diff_html_report

        out = diff_html_report(a, b, graph=graph, cluster=cluster, path=args.html, names=names,
                               global_batch=args.global_batch, graph_b=graph_b)
        print(f"wrote {out}")
    return 0


def _cmd_what_if(args: argparse.Namespace, *, graph_of: GraphOf, cluster_of: ClusterOf,
                 usage: type[Exception]) -> int:
    if args.cluster is None and args.devices is None:
        raise usage("what-if needs the other hardware: --cluster PRESET with --nodes K or --devices N")
    plan = _read(args.plan, usage)
    graph = _graph(plan, args.factory, graph_of, usage, args.plan, args.dtype)
    cluster = cluster_of(args)
    assert cluster is not None
    print(what_if(plan, graph, cluster, global_batch=args.global_batch, dtype=args.dtype,
                  search_too=not args.no_search).text())
    return 0
