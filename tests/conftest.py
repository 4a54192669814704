"""Suite-wide options: the device of the device-parametrized subset (`-m device`)."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE_ENV = "SLIME_CORR_TEST_DEVICE"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default=None,
                     help=f"device of the `-m device` tests: cpu (default), cuda, cuda:1 ... (or ${DEVICE_ENV})")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "device: runs on the device of --device / $SLIME_CORR_TEST_DEVICE "
                                       "(scripts/gpu_check.sh runs them on CUDA)")


@pytest.fixture(scope="session")
def test_device(request: pytest.FixtureRequest) -> torch.device:
    """The device the `device` tests put their tensors on; asking for CUDA without one is an error, not a skip."""
    name = request.config.getoption("--device") or os.environ.get(DEVICE_ENV) or "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.fail(f"--device / ${DEVICE_ENV} = {name!r}, but torch.cuda.is_available() is False "
                    f"(torch {torch.__version__}): install a CUDA build of torch or run with cpu.")
    return device
