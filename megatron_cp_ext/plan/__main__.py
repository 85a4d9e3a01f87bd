"""``python -m megatron_cp_ext.plan``: see :mod:`megatron_cp_ext.plan.cli`."""

import sys

from .cli import main

sys.exit(main())
