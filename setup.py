"""Install megatron_cp_ext. The CUDA extension (csrc/) is optional: MCX_BUILD_CUDA=1 builds it."""

import os
import sys

from setuptools import find_packages, setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ext_modules, cmdclass = [], {}
if os.environ.get("MCX_BUILD_CUDA") == "1":
    from torch.utils.cpp_extension import BuildExtension

    from build_ext_support import cuda_extension

    ext = cuda_extension()
    if ext is not None:
        ext_modules, cmdclass = [ext], {"build_ext": BuildExtension}

setup(
    name="megatron_cp_ext",
    version="0.1.0",
    description="Context parallelism for attention on packed variable-length sequences (Megatron-core, NeMo)",
    packages=find_packages(include=["megatron_cp_ext", "megatron_cp_ext.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "einops", "numpy"],
    extras_require={
        "test": ["pytest>=7", "ruff"],
        "megatron": ["megatron-core==0.16.1"],
        # nemo_run 0.11.1 fails to import with newer leptonai releases
        "nemo": ["nemo_run==0.11.1", "leptonai==0.27.3"],
        "gpu": ["flash-attn"],
        "plot": ["matplotlib"],
    },
    entry_points={"console_scripts": ["mcx-plan=megatron_cp_ext.plan.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
