"""Build support for the optional CUDA extension ``megatron_cp_ext._C`` (see docs/kernels.md).

``setup.py`` calls :func:`cuda_extension`. The nvcc compile test (tests/L0/test_csrc_compiles.py)
reuses :func:`sources` and :func:`nvcc_flags`, so it checks exactly what a build compiles.
Building is opt-in (``MCX_BUILD_CUDA=1``): the package is complete without the kernels, and a
plain install must not fail on machines without a CUDA toolkit.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
DEFAULT_ARCHS = "8.0;9.0"  # Ampere and Hopper; sm_80 is also the kernels' floor (bf16 atomics)
_ARCH = re.compile(r"^(\d+)\.(\d+)([af]?)(\+PTX)?$")


def sources() -> list[str]:
    """Kernel and binding sources, relative to the repository root (as setuptools wants)."""
    csrc = ROOT / "csrc"
    return sorted(p.relative_to(ROOT).as_posix() for p in csrc.glob("*") if p.suffix in {".cu", ".cpp"})


def gencode_flags(arch_list: str | None = None) -> list[str]:
    """nvcc ``-gencode`` flags for a ``TORCH_CUDA_ARCH_LIST``-style list ("8.0;9.0+PTX").

    Given explicitly, these also stop torch's build from appending its own arch guesses.
    """
    spec = arch_list or os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_ARCHS
    flags = []
    for arch in spec.replace(",", ";").replace(" ", ";").split(";"):
        if not arch:
            continue
        m = _ARCH.match(arch)
        if m is None:
            raise ValueError(f"bad CUDA arch {arch!r}: expected entries like 8.0, 9.0a or 9.0+PTX")
        num = f"{m[1]}{m[2]}{m[3]}"
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if m[4]:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def nvcc_flags(arch_list: str | None = None) -> list[str]:
    """nvcc flags. No ``--use_fast_math``: the merge must match the torch fallback exactly."""
    return ["-O3", *gencode_flags(arch_list)]


def _skip(reason: str) -> None:
    print(f"megatron_cp_ext: not building the CUDA extension: {reason}", file=sys.stderr)


def cuda_extension():
    """The ``megatron_cp_ext._C`` ``CUDAExtension`` if a build is requested and possible.

    Returns None (with a note on stderr when ``MCX_BUILD_CUDA=1`` was set) if the build was
    not requested, torch has no CUDA, or no nvcc is found.
    """
    if os.environ.get("MCX_BUILD_CUDA", "0") != "1":
        return None
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, CUDAExtension

    if torch.version.cuda is None:
        _skip(f"torch {torch.__version__} is a CPU-only build")
        return None
    if CUDA_HOME is None or not (shutil.which("nvcc") or Path(CUDA_HOME, "bin", "nvcc").exists()):
        _skip("no CUDA toolkit (nvcc) found; set CUDA_HOME")
        return None
    return CUDAExtension(
        name="megatron_cp_ext._C",
        sources=sources(),
        extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc_flags()},
    )
