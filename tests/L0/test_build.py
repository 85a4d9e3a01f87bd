"""The install decides correctly whether to build the CUDA extension, and finds the user's torch
from inside pip's isolated build environment.

The last test runs a real ``pip install -e .`` (default build isolation) into a throwaway venv
that sees this interpreter's torch: on a CPU machine it must succeed without compiling, and
``MCX_BUILD_CUDA=1`` must fail with the reason. About 30 s (two isolated builds).

The throwaway venv reaches this interpreter's packages through a ``.pth`` file listing its
site-packages directories, not through ``--system-site-packages``: when this interpreter is
itself a venv, ``--system-site-packages`` would expose the *base* interpreter's packages, which
need not include torch.
"""

from __future__ import annotations

import importlib.util
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("build_ext_support", ROOT / "build_ext_support.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("build_ext_support", module)
    spec.loader.exec_module(module)
    return module


B = _load()
CUDA_TORCH = B.TorchInfo(site_dir="/x", version="2.13.0+cu130", cuda="13.0")
CPU_TORCH = B.TorchInfo(site_dir="/x", version="2.13.0+cpu", cuda=None)


@pytest.mark.parametrize(
    "request_,torch_info,nvcc,build,reason",
    [
        (None, CUDA_TORCH, "/cuda/bin/nvcc", True, "CUDA 13.0"),
        ("auto", CUDA_TORCH, "/cuda/bin/nvcc", True, "/cuda/bin/nvcc"),
        ("1", CUDA_TORCH, "/cuda/bin/nvcc", True, "2.13.0+cu130"),
        ("0", CUDA_TORCH, "/cuda/bin/nvcc", False, "MCX_BUILD_CUDA=0"),
        (None, CPU_TORCH, "/cuda/bin/nvcc", False, "CPU-only"),
        (None, None, "/cuda/bin/nvcc", False, "not installed"),
        (None, CUDA_TORCH, None, False, "no nvcc"),
        ("", None, None, False, "not installed"),
        ("0", None, None, False, "MCX_BUILD_CUDA=0"),
    ],
)
def test_decide(request_, torch_info, nvcc, build, reason) -> None:
    decision = B.decide(request_, torch_info, nvcc)
    assert decision.build is build and reason in decision.reason
    assert (decision.torch is torch_info) if build else decision.torch is None


@pytest.mark.parametrize(
    "torch_info,nvcc,match",
    [(CPU_TORCH, "/nvcc", "CPU-only"), (None, "/nvcc", "install your CUDA torch"), (CUDA_TORCH, None, "CUDA_HOME")],
)
def test_forced_build_fails_naming_what_is_missing(torch_info, nvcc, match) -> None:
    with pytest.raises(B.CudaBuildError, match=match):
        B.decide("1", torch_info, nvcc)


def test_default_archs_carry_ptx_for_newer_gpus(monkeypatch) -> None:
    """Ampere and Hopper binaries, and Hopper's PTX: a newer GPU (Blackwell) compiles the
    kernels at load instead of failing at the first launch with no kernel image."""
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    assert B.gencode_flags() == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]


def test_unknown_request_is_an_error() -> None:
    with pytest.raises(ValueError, match="0, 1 or auto"):
        B.decide("yes", CUDA_TORCH, "/nvcc")


def test_find_nvcc_prefers_cuda_home(tmp_path: Path) -> None:
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("")
    nvcc.chmod(0o755)
    assert B.find_nvcc({"CUDA_HOME": str(tmp_path), "PATH": ""}) == str(nvcc)
    assert B.find_nvcc({"CUDA_PATH": str(tmp_path), "PATH": ""}) == str(nvcc)
    # a CUDA_HOME without nvcc is not silently replaced by another toolkit
    assert B.find_nvcc({"CUDA_HOME": str(tmp_path / "none"), "PATH": str(nvcc.parent)}) is None
    assert B.find_nvcc({"PATH": str(nvcc.parent)}) == str(nvcc)


def test_discover_torch_sees_through_build_isolation(monkeypatch, tmp_path: Path) -> None:
    # What pip's isolated environment sets: a PYTHONPATH that hides site-packages, no user site.
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("PYTHONNOUSERSITE", "1")
    info = B.discover_torch()
    assert info is not None
    assert info.version == torch.__version__ and info.cuda == torch.version.cuda
    assert Path(info.site_dir, "torch", "__init__.py").resolve() == Path(torch.__file__).resolve()


def test_discover_torch_none_without_torch(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "v")], check=True)
    assert B.discover_torch(str(tmp_path / "v" / "bin" / "python")) is None
    assert B.discover_torch(str(tmp_path / "no-such-python")) is None


def _pip_install(venv: Path, **env: str) -> subprocess.CompletedProcess:
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "install", "-v", "--no-deps", "-e", str(ROOT)]
    full_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", B.ENV)} | env
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=600, check=False)


def _outer_site_dirs() -> list[str]:
    """This interpreter's site-packages directories (a venv's own, and its base's when the venv
    was made with --system-site-packages), and the directory torch is imported from."""
    dirs = [*site.getsitepackages(), str(Path(torch.__file__).resolve().parents[1])]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return list(dict.fromkeys(d for d in dirs if Path(d).is_dir()))


def _venv_seeing_this_interpreter(venv: Path) -> None:
    """A fresh venv (own pip) whose ``sys.path`` ends with this interpreter's site directories.

    Plain path lines: the outer directories' own ``.pth`` files (e.g. an editable install of this
    package from another checkout) are not run, so the venv's editable install is the only one.
    """
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    purelib = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "zz_outer_site.pth").write_text("\n".join(_outer_site_dirs()) + "\n")


def test_pip_install_editable_on_cpu_builds_nothing(tmp_path: Path) -> None:
    if B.build_wanted().build:
        pytest.skip("this machine would build the CUDA extension (CUDA torch and nvcc)")
    venv = tmp_path / "venv"
    _venv_seeing_this_interpreter(venv)
    proc = _pip_install(venv)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "not building the CUDA extension" in proc.stdout + proc.stderr
    probe = "import megatron_cp_ext, megatron_cp_ext.runtime.ops as o; print(megatron_cp_ext.__file__, o.HAS_CUDA_EXT)"
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.split()
    assert Path(out[0]).resolve() == (ROOT / "megatron_cp_ext" / "__init__.py").resolve() and out[1] == "False"
    forced = _pip_install(venv, MCX_BUILD_CUDA="1")
    assert forced.returncode != 0 and "MCX_BUILD_CUDA=1 but the CUDA extension cannot be built" in (
        forced.stdout + forced.stderr
    )
