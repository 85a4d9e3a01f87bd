"""Every ``csrc/`` source compiles with nvcc, using the flags of a real build.

No GPU is needed: this is the check that the kernels and their torch glue type-check against
the installed torch headers and CUDA toolkit. It compiles to object files only (a CPU torch
has no CUDA libraries to link against) for the default archs (sm_80, sm_90 and compute_90's PTX, or
``TORCH_CUDA_ARCH_LIST``). One nvcc per core at a time (about 20 s on 2 cores); skipped when nvcc is not on PATH.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.utils.cpp_extension import include_paths

ROOT = Path(__file__).resolve().parents[2]
NVCC = shutil.which("nvcc")


def _build_support():
    spec = importlib.util.spec_from_file_location("build_ext_support", ROOT / "build_ext_support.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_BUILD = _build_support()


def _torch_flags() -> list[str]:
    """What torch's CUDAExtension would pass besides our own flags."""
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ["-std=c++20", "-Xcompiler", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    flags += [f"-I{p}" for p in (*include_paths(), sysconfig.get_paths()["include"])]
    # CPU wheels of torch lack this generated header; it only matters on Windows.
    if not any(Path(p, "c10/cuda/impl/cuda_cmake_macros.h").exists() for p in include_paths()):
        flags.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    return flags


def _compile(source: str, obj: Path) -> tuple[list[str], subprocess.CompletedProcess]:
    # Our own kernel files must also be warning-free; torch's headers are not ours to fix.
    strict = ["--Werror", "all-warnings"] if source.endswith(".cu") else []
    cmd = [NVCC, "-c", str(ROOT / source), "-o", str(obj)] + _BUILD.nvcc_flags() + _torch_flags() + strict
    return cmd, subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    """Every source's nvcc run, started together (one per core at a time), by source."""
    out = tmp_path_factory.mktemp("csrc")
    pool = ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1))
    jobs = {s: (out / f"{i}.o", pool.submit(_compile, s, out / f"{i}.o")) for i, s in enumerate(_BUILD.sources())}
    yield jobs
    pool.shutdown(cancel_futures=True)


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("source", _BUILD.sources())
def test_source_compiles(source: str, compiled: dict) -> None:
    obj, job = compiled[source]
    cmd, proc = job.result()
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    assert obj.stat().st_size > 0


def test_sources_found() -> None:
    """Guards the parametrization above against silently compiling nothing."""
    names = {Path(s).name for s in _BUILD.sources()}
    assert {"gather_rows.cu", "index_add_rows.cu", "merge_partial.cu", "ops.cpp"} <= names


def test_fake_impls_live_where_the_library_says() -> None:
    """torch checks, on the first fake-tensor trace of a csrc op (torch.compile, opcheck), that
    its fake impl was registered from the module ``set_python_module`` names, and raises
    otherwise: only a GPU build reaches that check, so the names are compared here. Every
    schema defined in ``ops.cpp`` needs a fake impl in that module."""
    text = (ROOT / "csrc" / "ops.cpp").read_text()
    modules = re.findall(r'set_python_module\("([\w.]+)"\)', text)
    ops = re.findall(r'm\.def\(\s*"(\w+)\(', text)
    assert len(modules) == 1 and len(ops) >= 5, (modules, ops)
    spec = importlib.util.find_spec(modules[0])
    assert spec is not None and spec.origin, f"ops.cpp names {modules[0]}, which does not exist"
    source = Path(spec.origin).read_text()
    fakes = set(re.findall(r'register_fake\("megatron_cp_ext::(\w+)"\)', source))
    assert set(ops) <= fakes, f"no fake impl in {modules[0]} for {sorted(set(ops) - fakes)}"
