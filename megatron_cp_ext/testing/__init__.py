"""Test utilities shipped with the package: the gloo worker pool and the dense reference."""
