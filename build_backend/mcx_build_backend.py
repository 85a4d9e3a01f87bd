"""In-tree PEP 517 backend: setuptools' own, plus ninja in the build requirements when the CUDA
extension will be built (torch's extension build compiles in parallel only with ninja).

Everything else, including finding the user's torch from inside pip's isolated build
environment, is in ``build_ext_support.py`` (called by ``setup.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import (  # noqa: F401 - the hooks this backend passes through unchanged
    build_editable,
    build_sdist,
    build_wheel,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import build_ext_support  # noqa: E402


def _extra_requires() -> list[str]:
    return ["ninja"] if build_ext_support.build_wanted().build else []


def get_requires_for_build_wheel(config_settings=None) -> list[str]:
    return _setuptools.get_requires_for_build_wheel(config_settings) + _extra_requires()


def get_requires_for_build_editable(config_settings=None) -> list[str]:
    return _setuptools.get_requires_for_build_editable(config_settings) + _extra_requires()
