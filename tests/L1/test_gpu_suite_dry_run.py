"""``benchmarks/gpu_suite.py --dry-run``: every step of the GPU program runs on the CPU through
the same code and writes its file; what a lent GPU machine hands back fits its limits."""

import json
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_suite  # noqa: E402
import report  # noqa: E402

from megatron_cp_ext.backends import pick  # noqa: E402


def test_dry_run_runs_every_step(tmp_path):
    out = tmp_path / "suite"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--out", str(out), "--dry-run"],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    files = sorted(p.name for p in out.iterdir())
    assert all(p.is_file() for p in out.iterdir())  # no folders
    assert len(files) <= 8, files
    assert set(files) == {s.log for s in gpu_suite.STEPS} | {"cpu-dry-run.md"}, files
    for step in gpu_suite.STEPS:
        if step.log.endswith(".log"):
            text = (out / step.log).read_text()
            assert f"step {step.name}: ok" in text, text[-2000:]
    suite = ET.parse(out / "tests.xml").getroot()
    cases = suite.iter("testcase")
    assert all(c.find("failure") is None and c.find("error") is None for c in cases)
    report = (out / "cpu-dry-run.md").read_text()
    for step in gpu_suite.STEPS:
        assert f"| {step.name} | ok |" in report
    # every benchmark produced rows: kernels, attention per mask, CP per comm type and size
    for needle in (
        "| gather_rows bf16 |",
        "| reference | window |",
        "| a2a+p2p | causal | 8 |",
        "| cp1 | causal | 1 |",
        "| a2a+p2p | 8 | nan |",  # memory per rank: the accounting only, on CPU
    ):
        assert needle in report, needle
    assert "| h100-nvlink-ib400 |" in report
    assert "## Overlap of one p2p layer" in report  # its row comes from a GPU run's tests.xml
    # the kernel pick table entry a GPU run would commit: valid, loadable, the CPU's kernel
    entry = json.loads(report.split("```json\n", 1)[1].split("```", 1)[0])
    table = tmp_path / "kernel_table.json"
    table.write_text(json.dumps({"devices": entry}))
    rules = pick.load_table(str(table))["devices"]["cpu"]["rules"]
    assert {(r["mask"], r["measured_tokens"]) for r in rules} == {(m, t) for m in ("causal", "none", "window")
                                                                  for t in (96, 384)}  # fmt: skip
    assert {r["kernel"] for r in rules} == {"reference"}
    assert not (ROOT / "megatron_cp_ext" / "backends" / "kernel_table.json").read_text().count('"cpu"')


def test_profile_dry_run():
    """``benchmarks/gpu_profile.py --dry-run``: the direct call, CP 1 and a ring run through the
    same code as on a GPU and print their tables (the CPU profiler sees the main thread only)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_profile.py"), "--dry-run", "--runs", "p2p:2,a2a:2"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for needle in ("### direct backend call", "### cp_attention at CP 1", "### p2p at CP 2", "### a2a at CP 2"):
        assert needle in proc.stdout, needle
    assert "cp_attention CP 1: host" in proc.stdout


def test_collect_reads_results_printed_by_tests(tmp_path):
    """The p2p overlap summary a GPU test prints reaches the report through the junit XML."""
    row = {"step": "overlap", "compute_kernels": 16, "transfers": 12, "compute_us": 900.0, "transfer_us": 200.0,
           "overlap_us": 150.0, "streams": [7]}  # fmt: skip
    out = f"<system-out>noise\nRESULT {json.dumps(row)}\n</system-out>"
    xml = f"<testsuite><testcase name='t'>{out}</testcase></testsuite>"
    (tmp_path / "tests.xml").write_text(xml.replace('"', "&quot;"))
    assert gpu_suite.collect(tmp_path) == [row]
    assert "| 16 | 12 | 900 | 200 | 150 | 0.75 |" in report.render([], [row], True, 1.0)[1]


def test_tests_step_out_of_time_keeps_what_ran(tmp_path, monkeypatch):
    """A tests step past its budget is interrupted, not killed: the junit XML still records the
    tests that finished (on a GPU lease there is no second chance to learn which passed); also
    where the calling process ignores SIGINT, as the full suite's process came to (the child
    inherited that, was killed after the grace and left no XML)."""
    monkeypatch.setattr(gpu_suite, "INTERRUPT_GRACE_S", 60.0)
    budget_s = 8.0  # a bare pytest start (no conftest here) and test_quick: about 1 s, 3 s loaded
    (tmp_path / "test_probe.py").write_text(
        "import time\n\ndef test_quick():\n    pass\n\ndef test_stuck():\n    time.sleep(600)\n"
    )
    out = tmp_path / "suite"
    out.mkdir()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        t0 = time.perf_counter()
        with pytest.raises(subprocess.TimeoutExpired):
            gpu_suite.run_tests(out, budget_s, True, (str(tmp_path / "test_probe.py"),))
        assert time.perf_counter() - t0 < budget_s + gpu_suite.INTERRUPT_GRACE_S + 5  # the stuck test did not run on
    finally:
        signal.signal(signal.SIGINT, previous)
    cases = {c.get("name"): c for c in ET.parse(out / "tests.xml").getroot().iter("testcase")}
    assert "test_quick" in cases and cases["test_quick"].find("failure") is None, cases
    assert [p.name for p in out.iterdir()] == ["tests.xml"]  # the console stays out of DIR


def test_deadline_skips_what_does_not_fit_and_still_reports(tmp_path):
    """``--deadline``: budgets are cut to what is left; a step left under ``MIN_STEP_S`` is
    skipped (not started), and the report is written all the same (also after every step)."""
    out = tmp_path / "late"
    assert gpu_suite.main(["--out", str(out), "--dry-run", "--deadline", "1", "--only", "env,kernels"]) == 1
    (path,) = out.glob("*.md")  # the device is unknown: its step did not run
    report_text = path.read_text()
    assert "| env | skipped (deadline) |" in report_text and "| kernels | skipped (deadline) |" in report_text
    assert not (out / "env.log").exists()
    step = next(s for s in gpu_suite.STEPS if s.name == "env")
    cut = gpu_suite.run_step(step, out, dry=True, left_s=gpu_suite.MIN_STEP_S - 1)
    assert cut["status"] == "skipped (deadline)" and cut["seconds"] == 0.0
