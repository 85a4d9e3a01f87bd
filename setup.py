"""Install megatron_cp_ext.

The CUDA extension (csrc/) builds by default when torch has CUDA and nvcc is found, and is
skipped otherwise; MCX_BUILD_CUDA=0 opts out, MCX_BUILD_CUDA=1 fails unless it builds.
See build_ext_support.py and docs/kernels.md.
"""

import os
import sys

from setuptools import find_packages, setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from build_ext_support import cuda_build  # noqa: E402

ext_modules, cmdclass = cuda_build()

setup(
    name="megatron_cp_ext",
    version="0.1.0",
    description="Context parallelism for attention on packed variable-length sequences (Megatron-core, NeMo)",
    packages=find_packages(include=["megatron_cp_ext", "megatron_cp_ext.*"]),
    package_data={  # measured kernel constants (when present) and kernel picks per device class
        "megatron_cp_ext.planner": ["calibration.json"],
        "megatron_cp_ext.backends": ["kernel_table.json"],
    },
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "einops", "numpy"],
    extras_require={
        "test": ["pytest>=7", "ruff", "matplotlib"],  # matplotlib: the planner's --plot test
        # tested: 0.16.1 (Python 3.10+), 0.17.1, 0.18.2, 0.19.2 (these declare Python >= 3.12)
        "megatron": ["megatron-core>=0.16.1,<0.20"],
        # nemo_run 0.11.1 fails to import with newer leptonai releases
        "nemo": ["nemo_run==0.11.1", "leptonai==0.27.3"],
        "gpu": ["flash-attn"],
        # the cuDNN candidate (backends/cudnn.py): cudnn-frontend's graphs over torch's libcudnn
        "cudnn": ["nvidia-cudnn-frontend>=1.32"],
        # the FlashAttention-4 candidate (backends/fa4.py): CuTe DSL kernels for Hopper/Blackwell
        "fa4": ["flash-attn-4>=4.0.0b36"],
        "plot": ["matplotlib"],
    },
    entry_points={"console_scripts": ["mcx-plan=megatron_cp_ext.planner.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
