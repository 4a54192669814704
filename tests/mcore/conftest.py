"""Megatron-glue tests: apply the CPU adaptations once per session (a no-op on CUDA machines)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _cpu_compat() -> None:
    from slime_corr.mcore.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
