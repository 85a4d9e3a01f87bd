"""GPU test configuration: registers the ``gpu`` marker (also declared in the project config)."""


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
