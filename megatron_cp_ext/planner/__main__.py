"""``python -m megatron_cp_ext.planner``: see :mod:`megatron_cp_ext.planner.cli`."""

import sys

from .cli import main

sys.exit(main())
