"""The four-process layouts of test_mcore_parallel.py (DP=4, TP=2×DP=2, CP=2×DP=2, CP=4, TP=2×CP=2, TP=4; the same
worker, cases and reference; the communication count of a class of cases once: `communication_checked`), in a file
of their own so that a parallel test run (`scripts/test.sh`: pytest-xdist, one worker per file) runs them beside the
two-process layouts instead of after them."""

from __future__ import annotations

import pytest

from tests.mcore.mcore_helpers import spawn
from tests.mcore.test_mcore_parallel import _worker

pytestmark = pytest.mark.cost(160)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)


def test_presets_under_four_process_layouts_match_single_rank_reference():
    spawn(_worker, 4)
