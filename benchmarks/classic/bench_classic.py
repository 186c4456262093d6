"""Step time of our classic OSS, ShardedDataParallel and Pipe against the original FairScale 0.4.13.

    python benchmarks/classic/bench_classic.py                  # sets up /tmp/fs013 if missing
    python benchmarks/classic/bench_classic.py --tiny           # seconds: checks everything runs
    python benchmarks/classic/bench_classic.py --no-original    # ours only

The original runs from its own virtual environment (``/tmp/fs013``), created here with
``python -m venv --system-site-packages /tmp/fs013 && /tmp/fs013/bin/pip install torch==2.13.0
fairscale==0.4.13``: the venv sees the already-installed torch 2.13.0, so pip keeps it and only adds
fairscale 0.4.13 to the venv (whose site-packages shadow this repository's editable install).
Both implementations run the same worker script (``classic_worker.py``, public FairScale API only),
on CPU with gloo, alternating ours/original ``--repeats`` times in the same invocation; the ratio
is ours / original of the median step time (slowest rank). Goal: ratio ≤ 1.0.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
VENV = Path("/tmp/fs013")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def setup_original(venv: Path) -> tuple[bool, str]:
    """Create the venv with FairScale 0.4.13; returns (ok, message)."""
    python = venv / "bin" / "python"
    if not python.exists():
        r = subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                           capture_output=True, text=True)
        if r.returncode:
            return False, f"venv creation failed: {r.stderr[-2000:]}"
    check = subprocess.run([str(python), "-c", "import fairscale; print(fairscale.__version__)"],
                           capture_output=True, text=True, cwd="/tmp", env=_original_env())
    if check.returncode == 0 and check.stdout.strip() == "0.4.13":
        return True, "fairscale 0.4.13 already installed"
    r = subprocess.run([str(venv / "bin" / "pip"), "install", "torch==2.13.0", "fairscale==0.4.13"],
                       capture_output=True, text=True)
    if r.returncode:
        return False, f"pip install fairscale==0.4.13 failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    check = subprocess.run([str(python), "-c", "import fairscale; print(fairscale.__version__)"],
                           capture_output=True, text=True, cwd="/tmp", env=_original_env())
    if check.stdout.strip() != "0.4.13":
        return False, f"the venv imports fairscale {check.stdout.strip() or '?'}: {check.stderr[-1000:]}"
    return True, "installed fairscale 0.4.13"


def _original_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _ours_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_worker(python: str, env: dict[str, str], component: str, args: argparse.Namespace) -> dict:
    cmd = [python, str(HERE / "classic_worker.py"), "--component", component, "--world", str(args.world),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--dim", str(args.dim),
           "--layers", str(args.layers), "--batch", str(args.batch), "--chunks", str(args.chunks),
           "--port", str(_free_port())]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/tmp", timeout=args.timeout)
    if r.returncode:
        return {"error": (r.stderr or r.stdout)[-3000:]}
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1]
    out = json.loads(line)
    out["step_s"] = max(statistics.median(t) for t in out["per_rank"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--components", default="oss,sdp,pipe")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--tiny", action="store_true", help="a few small steps: check that everything runs")
    p.add_argument("--no-original", action="store_true")
    p.add_argument("--venv", default=str(VENV))
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    if args.tiny:
        args.steps, args.warmup, args.dim, args.layers, args.batch, args.repeats = 3, 1, 64, 2, 8, 1

    original_ok, note = (False, "skipped (--no-original)")
    if not args.no_original:
        original_ok, note = setup_original(Path(args.venv))
    print(f"original FairScale: {note}")
    results: dict[str, dict] = {}
    versions: dict[str, str | None] = {}
    for component in args.components.split(","):
        ours, orig, errors = [], [], []
        for _ in range(args.repeats):
            r = run_worker(sys.executable, _ours_env(), component, args)
            (ours.append(r["step_s"]) if "error" not in r else errors.append(("ours", r["error"])))
            versions["ours"] = r.get("fairscale", versions.get("ours"))
            if original_ok:
                r = run_worker(str(Path(args.venv) / "bin" / "python"), _original_env(), component, args)
                (orig.append(r["step_s"]) if "error" not in r else errors.append(("original", r["error"])))
                versions["original"] = r.get("fairscale", versions.get("original"))
        row: dict = {"ours_s": min(ours) if ours else None, "original_s": min(orig) if orig else None}
        if row["ours_s"] and row["original_s"]:
            row["ratio"] = row["ours_s"] / row["original_s"]
        if errors:
            row["errors"] = [f"{who}: {text.strip().splitlines()[-1] if text.strip() else '?'}" for who, text in errors]
            for who, text in errors:
                print(f"--- {component} {who} failed ---\n{text}", file=sys.stderr)
        results[component] = row
    print(f"fairscale versions run: {versions}")
    if original_ok and versions.get("original") != "0.4.13":
        print("WARNING: the original run did not import fairscale 0.4.13", file=sys.stderr)
    world = f"world={args.world}"
    print(f"\n{'component':<10}{'ours ms':>10}{'orig ms':>10}{'ratio':>8}   (CPU gloo, {world}, dim={args.dim}, "
          f"layers={args.layers}, batch={args.batch}, chunks={args.chunks}, best of {args.repeats})")
    for c, row in results.items():
        ours_ms = f"{row['ours_s'] * 1e3:.2f}" if row["ours_s"] else "-"
        orig_ms = f"{row['original_s'] * 1e3:.2f}" if row["original_s"] else "-"
        ratio = f"{row['ratio']:.3f}" if "ratio" in row else "-"
        print(f"{c:<10}{ours_ms:>10}{orig_ms:>10}{ratio:>8}" + (f"   errors: {row['errors']}" if "errors" in row else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "original": note, "versions": versions,
                                                "results": results}, indent=2))
    if any("errors" in row and row["ours_s"] is None for row in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
