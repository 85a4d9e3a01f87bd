"""The whole GPU program in one command: environment, csrc build, GPU tests, benchmarks,
calibration and the device report.

    python benchmarks/gpu_suite.py --out DIR [--dry-run] [--only STEP,...] [--deadline S]

Steps run in order, each in its own subprocess with its own time budget (whole runs took 3 to
4.5 minutes on an H100 and an H200; the budgets add up to under 14) and its own log in DIR; a
step that fails or runs out of time is recorded and the next one runs. DIR receives at most 8
files and no folders (what a lent GPU machine hands back): ``env.log``, ``build.log``,
``tests.xml`` (junit of ``tests/gpu``), ``kernels.log``, ``attention.log``, ``cp.log``,
``calibration.log`` and ``<device>.md``, the report in the shape of
``benchmarks/results/TEMPLATE.md``. ``--dry-run`` runs every step on the CPU with tiny sizes
through the same code (CPU kernels stand in); CI runs it.
See ``docs/gpu.md`` for what each figure means.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True, kw_only=True)
class Step:
    """One step of the suite."""

    name: str
    """Step name (``--only``) and the stem of its log file."""
    budget_s: float
    """Wall-clock limit on the GPU; the dry run uses ``dry_budget_s``."""
    dry_budget_s: float
    log: str
    """File in DIR the step writes (its log, or the junit XML for the tests)."""


INTERRUPT_GRACE_S = 20.0
"""After the tests step's budget, how long pytest gets to write its report before it is killed."""

MIN_STEP_S = 10.0
"""Under ``--deadline``, a step that would get less than this is skipped (reported as such)."""

REPORT_RESERVE_S = 15.0
"""Under ``--deadline``, the seconds kept back for the last report."""

STEPS = [
    Step(name="env", budget_s=20, dry_budget_s=120, log="env.log"),
    Step(name="build", budget_s=100, dry_budget_s=120, log="build.log"),
    Step(name="tests", budget_s=300, dry_budget_s=180, log="tests.xml"),
    Step(name="kernels", budget_s=30, dry_budget_s=120, log="kernels.log"),
    Step(name="attention", budget_s=150, dry_budget_s=120, log="attention.log"),
    Step(name="cp", budget_s=180, dry_budget_s=240, log="cp.log"),
    Step(name="calibration", budget_s=40, dry_budget_s=120, log="calibration.log"),
]


# ---- steps that are not benchmarks ------------------------------------------------------------
def step_env(dry: bool) -> None:
    """Device, torch, CUDA, cuDNN, and which local kernels import."""
    import importlib.util

    import torch

    from megatron_cp_ext.runtime import ops

    cuda = torch.cuda.is_available()
    print(f"python {sys.version.split()[0]}; torch {torch.__version__}; CUDA {torch.version.cuda}; "
          f"cuDNN {torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}")  # fmt: skip
    if cuda:
        p = torch.cuda.get_device_properties(0)
        print(
            f"device {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB"
        )
    else:
        print("device: none (CPU)" + (" - dry run" if dry else ""))

    def found(mod: str) -> bool:
        try:
            return importlib.util.find_spec(mod) is not None
        except ImportError:  # a dotted name whose parent is missing
            return False

    mods = {m: found(m) for m in ("flash_attn", "flash_attn.cute", "cutlass", "cudnn")}
    from megatron_cp_ext.backends import cudnn

    if mods["cudnn"]:
        try:
            import cudnn as fe

            print(f"cudnn-frontend {getattr(fe, '__version__', '?')}, backend {fe.backend_version()}")
        except Exception as exc:  # noqa: BLE001 - reported, the candidate is then off
            print(f"cudnn-frontend does not load: {type(exc).__name__}: {exc}")
    kernels = {
        "csrc (megatron_cp_ext._C)": ops.HAS_CUDA_EXT,
        "aten flash varlen": hasattr(torch.ops.aten, "_flash_attention_forward"),
        "cuDNN graphs (backends/cudnn.py)": cudnn.available(),
        **{f"module {m}": ok for m, ok in mods.items()},
    }
    for k, v in kernels.items():
        print(f"{k}: {'yes' if v else 'no'}")
    device = torch.cuda.get_device_name() if cuda else "cpu-dry-run"
    print("RESULT " + json.dumps({"step": "env", "device": device, "torch": torch.__version__,
                                   "cuda": torch.version.cuda, "kernels": kernels}))  # fmt: skip


def step_build(dry: bool) -> None:
    """JIT-build ``csrc`` for this device's arch and install it as ``megatron_cp_ext._C``."""
    import sysconfig
    import tempfile

    import torch

    import build_ext_support as bes

    cuda = torch.cuda.is_available()
    arch = "{}.{}".format(*torch.cuda.get_device_capability()) if cuda else "9.0"
    flags = bes.nvcc_flags(arch)
    srcs = [str(ROOT / s) for s in bes.sources()]
    print(f"sources: {srcs}\nnvcc: {bes.find_nvcc()}\nflags: {flags}")
    if not cuda:
        print("no CUDA device: build skipped (the dry run checks the build inputs only)")
        return
    from torch.utils.cpp_extension import load

    build_dir = tempfile.mkdtemp(prefix="mcx_build_")
    t0 = time.perf_counter()
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch  # torch adds no arch guesses of its own
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    load(name="_C", sources=srcs, extra_cflags=["-O3"], extra_cuda_cflags=flags, build_directory=build_dir,
         verbose=True)  # fmt: skip
    built = next(Path(build_dir).glob("_C*.so"))
    dest = ROOT / "megatron_cp_ext" / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))
    shutil.copy(built, dest)
    print(f"built in {time.perf_counter() - t0:.0f} s -> {dest}")
    check = subprocess.run([sys.executable, "-c", "from megatron_cp_ext.runtime import ops; print(ops.HAS_CUDA_EXT)"],
                           cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    print(f"megatron_cp_ext.runtime.ops.HAS_CUDA_EXT in a fresh process: {check.stdout.strip()} {check.stderr[-500:]}")


def _sigint_default() -> None:
    """In the child: SIGINT as Python expects it. An ignored SIGINT is inherited across exec
    (a parent that ignores it, as a test process did, made pytest deaf to the interrupt:
    killed after the grace, no XML)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_tests(out: Path, budget: float, dry: bool, paths: tuple[str, ...] = ()) -> tuple[int, str]:
    """``tests/gpu`` (or ``paths``) with junit XML into DIR; the console tail goes to the suite's
    output. Out of time, pytest is interrupted (SIGINT) rather than killed, so the XML still
    records every test that ran (a lease's one chance at the figures); then
    ``subprocess.TimeoutExpired`` as for the other steps."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(paths or [str(ROOT / "tests" / "gpu")]),
           f"--junitxml={out / 'tests.xml'}", "-o", "junit_family=xunit1",
           "-o", "junit_logging=system-out"]  # fmt: skip  # printed RESULT lines (the p2p overlap) kept
    with tempfile.TemporaryFile("w+") as console:  # not a pipe: nothing blocks on a full one; not in DIR
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=console, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=_sigint_default)  # fmt: skip
        try:
            rc = proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # pytest writes its report for the tests so far
            try:
                proc.wait(timeout=INTERRUPT_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            console.seek(0)
            print(console.read()[-3000:])
            raise
        console.seek(0)
        tail = console.read()[-3000:]
    return rc, tail


# ---- the driver --------------------------------------------------------------------------------
def _child(name: str, dry: bool) -> None:
    if name == "env":
        step_env(dry)
    elif name == "build":
        step_build(dry)
    else:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import gpu_bench

        s = gpu_bench.sizes(dry)
        import torch

        torch.manual_seed(0)
        gpu_bench.STEPS[name](s)


def run_step(step: Step, out: Path, dry: bool, left_s: float | None = None) -> dict:
    """Run one step within its budget, cut to ``left_s`` (what ``--deadline`` leaves)."""
    budget = step.dry_budget_s if dry else step.budget_s
    if left_s is not None:
        budget = min(budget, left_s - (INTERRUPT_GRACE_S if step.name == "tests" else 0))
    if budget < MIN_STEP_S:
        return {"step": step.name, "status": "skipped (deadline)", "seconds": 0.0, "log": step.log}
    t0 = time.perf_counter()
    try:
        if step.name == "tests":
            rc, tail = run_tests(out, budget, dry)
            print(tail)
        else:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", step.name] + (["--dry-run"] if dry else [])
            with open(out / step.log, "w") as log:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=budget).returncode
        status = "ok" if rc == 0 else f"failed (exit {rc})"
    except subprocess.TimeoutExpired:
        status = f"out of time ({budget:.0f} s)"
    took = time.perf_counter() - t0
    if step.name != "tests":
        with open(out / step.log, "a") as log:
            log.write(f"\n[suite] step {step.name}: {status} in {took:.1f} s\n")
    return {"step": step.name, "status": status, "seconds": took, "log": step.log}


def collect(out: Path) -> list[dict]:
    """The ``RESULT`` lines of every step log, and of the tests' captured output in the junit
    XML (the p2p layer's overlap summary)."""
    import xml.etree.ElementTree as ET

    rows = []
    for step in STEPS:
        path = out / step.log
        if not path.exists():
            continue
        text = path.read_text()
        if path.suffix == ".xml":
            text = "\n".join(e.text or "" for e in ET.fromstring(text).iter("system-out"))
        rows += [json.loads(m) for m in re.findall(r"^RESULT (.*)$", text, flags=re.M)]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="folder for the logs and the report (created)")
    ap.add_argument("--dry-run", action="store_true", help="every step on the CPU with tiny sizes")
    ap.add_argument("--only", default="", help="comma-separated steps (default: all)")
    ap.add_argument(
        "--deadline", type=float, default=None,
        help="seconds for the whole run: budgets are cut to what is left and late steps skipped "
        "(the report is rewritten after every step, so a killed run still leaves one)",
    )  # fmt: skip
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args.child, args.dry_run)
        return 0
    if args.out is None:
        ap.error("--out is required")
    import report

    args.out.mkdir(parents=True, exist_ok=True)
    only = {x for x in args.only.split(",") if x}
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    t0 = time.perf_counter()
    statuses = []
    for step in STEPS:
        if only and step.name not in only:
            continue
        left = None if args.deadline is None else args.deadline - REPORT_RESERVE_S - (time.perf_counter() - t0)
        st = run_step(step, args.out, args.dry_run, left)
        statuses.append(st)
        print(
            f"[suite] {st['step']:<12} {st['status']:<24} {st['seconds']:6.1f} s  -> {args.out / st['log']}", flush=True
        )
        report.write(args.out, statuses, collect(args.out), dry=args.dry_run, total_s=time.perf_counter() - t0)
    path = report.write(args.out, statuses, collect(args.out), dry=args.dry_run, total_s=time.perf_counter() - t0)
    print(f"[suite] report -> {path}  ({time.perf_counter() - t0:.0f} s in all)")
    print(path.read_text())
    return 0 if all(s["status"] == "ok" for s in statuses) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
