"""Test utilities shipped with the package: the gloo worker pool and the dense reference."""

import contextlib as _contextlib


@_contextlib.contextmanager
def reference_kernels(fwd, bwd):
    """Within the block, the ``reference`` backend runs ``fwd``/``bwd`` as its varlen kernel
    (stand-ins with the same contract: a flash-shaped stub, a sync-free dense kernel)."""
    from ..backends import reference

    saved = reference.attn_fwd, reference.attn_bwd
    reference.attn_fwd, reference.attn_bwd = fwd, bwd
    try:
        yield
    finally:
        reference.attn_fwd, reference.attn_bwd = saved
