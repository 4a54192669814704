"""Partial rollouts on the REAL SGLang server (bf16, CPU) behind the real sglang-router: `--partial-rollout` syncs
the weights (distributed, gloo) while the next rollout's requests are running; SGLang pauses (abort), loads them,
continues, and the client resumes every interrupted request under the new weights. The run must finish with the
engine on the last weights, the staleness bound kept, and samples whose versions change mid-response (logged as
`rollout/partial_samples`). SGLang's own throttle (0.1 s per forward) keeps each rollout's 48-token responses
in flight for >= 4.8 s, longer than a training step on any machine: the update lands mid-request for certain."""

from __future__ import annotations

import pytest

from tests.job_runner import run_main_job
from tests.real_sglang.sglang_helpers import ServerSpec, slowed_down
from tests.real_sglang.test_sglang_trainer import RUN_TIMEOUT, metrics, versions

pytestmark = pytest.mark.cost(40)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)


@pytest.fixture(scope="module")
def server(shared_servers, tiny_opt):
    return shared_servers(ServerSpec(tiny_opt["v0"], dtype="bfloat16", name="bf16"))[0]  # test_sglang_trainer's A


def test_weight_updates_reach_requests_in_flight_through_the_router(server, tmp_path):
    from slime_corr.engines.router import start_router

    with start_router([server.url]) as router, slowed_down(server.url, 0.1):
        args = ["--num-rollout", "3", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
                "--num-steps-per-rollout", "1", "--rollout-max-response-len", "48", "--run-dir", str(tmp_path),
                "--sglang-url", router.url, "--rollout-correction-preset", "ppo_is_bypass",
                "--rollout-weight-sync", "distributed", "--async-rollout", "--partial-rollout"]
        out = run_main_job(args, timeout=RUN_TIMEOUT, output_dir=tmp_path.parent / f"{tmp_path.name}_output")

    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/staleness_oldest_max"] <= 1 for r in rows)
    assert rows[0]["rollout/partial_samples"] == 0 and sum(r["rollout/partial_samples"] for r in rows) > 0, rows
    assert versions([server.url])[server.url] == "step-3"
