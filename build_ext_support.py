"""Build support for the optional CUDA extension ``megatron_cp_ext._C`` (see docs/kernels.md).

Whether to build is decided by :func:`decide` from three facts: ``MCX_BUILD_CUDA``, the torch of
the interpreter being installed into, and an nvcc:

* ``MCX_BUILD_CUDA`` unset (or ``auto``): build when torch has CUDA and nvcc is found, else
  install the pure-Python package (the kernels are optional: every op has a torch fallback).
* ``MCX_BUILD_CUDA=1``: build, or fail the install saying what is missing.
* ``MCX_BUILD_CUDA=0``: never build.

pip builds in an isolated environment that holds only the build requirements, not torch. The
extension must be compiled against the user's own torch (its CUDA version and C++ ABI), never a
second torch downloaded for the build, so :func:`discover_torch` asks the same interpreter, with
the isolation undone, where its torch lives, and :func:`cuda_build` makes that directory
importable for the rest of the build. ``setup.py`` calls :func:`cuda_build`; the in-tree build
backend (``build_backend/``) calls :func:`build_wanted` to add ninja to the build requirements.
The nvcc compile test (tests/L0/test_csrc_compiles.py) reuses :func:`sources` and
:func:`nvcc_flags`, so it checks exactly what a build compiles.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
DEFAULT_ARCHS = "8.0;9.0+PTX"  # Ampere, Hopper, and PTX newer GPUs (Blackwell) compile at load; sm_80 is the floor
ENV = "MCX_BUILD_CUDA"
_ARCH = re.compile(r"^(\d+)\.(\d+)([af]?)(\+PTX)?$")
# What pip's isolated build environment sets to hide the user's site-packages.
_ISOLATION_VARS = ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME", "PYTHONSAFEPATH")
_PROBE = (
    "import json, os, torch; "
    "print(json.dumps({'site_dir': os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__))), "
    "'version': torch.__version__, 'cuda': torch.version.cuda}))"
)


class CudaBuildError(RuntimeError):
    """``MCX_BUILD_CUDA=1`` was set but the extension cannot be built here."""


@dataclass(frozen=True, kw_only=True)
class TorchInfo:
    """The torch a build compiles against."""

    site_dir: str
    """Directory that holds the ``torch`` package (to put on ``sys.path``)."""
    version: str
    """``torch.__version__``."""
    cuda: str | None
    """``torch.version.cuda``: None for a CPU-only build of torch."""


@dataclass(frozen=True, kw_only=True)
class Decision:
    """Whether to build the extension, and why (printed by the build)."""

    build: bool
    """True: compile ``megatron_cp_ext._C``."""
    reason: str
    """One line for the build log."""
    torch: TorchInfo | None = None
    """The torch to compile against (set when ``build``)."""


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


def find_nvcc(environ: dict[str, str] | None = None) -> str | None:
    """nvcc as torch's build finds it: ``$CUDA_HOME``/``$CUDA_PATH``, then PATH, then /usr/local/cuda."""
    environ = os.environ if environ is None else environ
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = environ.get(var)
        if home:  # an explicit toolkit wins, and a wrong one is not silently replaced
            nvcc = Path(home, "bin", "nvcc")
            return str(nvcc) if nvcc.is_file() else None
    found = shutil.which("nvcc", path=environ.get("PATH"))
    if found:
        return found
    fallback = Path("/usr/local/cuda/bin/nvcc")
    return str(fallback) if fallback.is_file() else None


def discover_torch(python: str | None = None, timeout: float = 120.0) -> TorchInfo | None:
    """The torch that ``python`` (default: this interpreter) imports outside pip's build isolation.

    Runs ``python -c 'import torch'`` with the isolation variables removed and from a neutral
    directory, so it sees the environment the package is being installed into (user site
    included), not the build environment. None when that interpreter has no importable torch.
    """
    env = {k: v for k, v in os.environ.items() if k not in _ISOLATION_VARS}
    with tempfile.TemporaryDirectory() as cwd:
        try:
            proc = subprocess.run(
                [python or sys.executable, "-c", _PROBE],
                env=env,
                cwd=cwd,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
    if proc.returncode != 0:
        return None
    try:
        return TorchInfo(**json.loads(proc.stdout.strip().splitlines()[-1]))
    except (ValueError, TypeError, IndexError):
        return None


def decide(request: str | None, torch_info: TorchInfo | None, nvcc: str | None) -> Decision:
    """Build or not, from ``MCX_BUILD_CUDA`` (``request``), the torch found and the nvcc found.

    Raises CudaBuildError for ``MCX_BUILD_CUDA=1`` when a build is impossible, and ValueError for
    an unknown value (a typo must not silently skip or force a build).
    """
    request = (request or "auto").strip().lower()
    if request not in ("auto", "0", "1"):
        raise ValueError(f"{ENV} must be 0, 1 or auto (unset), got {request!r}")
    if request == "0":
        return Decision(build=False, reason=f"{ENV}=0")
    missing = []
    if torch_info is None:
        missing.append("torch is not installed in this interpreter (install your CUDA torch first)")
    elif torch_info.cuda is None:
        missing.append(f"torch {torch_info.version} is a CPU-only build")
    if nvcc is None:
        missing.append("no nvcc found (set CUDA_HOME or put nvcc on PATH)")
    if missing:
        if request == "1":
            raise CudaBuildError(f"{ENV}=1 but the CUDA extension cannot be built: " + "; ".join(missing))
        return Decision(build=False, reason="; ".join(missing))
    assert torch_info is not None and nvcc is not None
    reason = f"torch {torch_info.version} (CUDA {torch_info.cuda}) in {torch_info.site_dir}, {nvcc}"
    return Decision(build=True, reason=reason, torch=torch_info)


def build_wanted() -> Decision:
    """:func:`decide` for this process's environment (skips the torch probe when ``MCX_BUILD_CUDA=0``)."""
    request = os.environ.get(ENV)
    if (request or "").strip() == "0":
        return decide(request, None, None)
    return decide(request, discover_torch(), find_nvcc())


def _note(message: str) -> None:
    print(f"megatron_cp_ext: {message}", file=sys.stderr)


def cuda_build() -> tuple[list, dict]:
    """``(ext_modules, cmdclass)`` for ``setup()``: the ``megatron_cp_ext._C`` extension when
    :func:`build_wanted` says so, else nothing. Makes the discovered torch importable first."""
    decision = build_wanted()
    if not decision.build:
        _note(f"not building the CUDA extension: {decision.reason}")
        return [], {}
    _note(f"building the CUDA extension: {decision.reason}")
    assert decision.torch is not None
    if decision.torch.site_dir not in sys.path:
        # Appended, so the build environment's setuptools still wins over the user's copy.
        sys.path.append(decision.torch.site_dir)
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    ext = CUDAExtension(
        name="megatron_cp_ext._C",
        sources=sources(),
        extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc_flags()},
    )
    return [ext], {"build_ext": BuildExtension}
