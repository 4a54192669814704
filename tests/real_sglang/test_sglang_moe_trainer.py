"""The main job on the tiny Qwen3-MoE (`--model tiny-moe`) against the REAL SGLang server in bf16 with
`--enable-return-routed-experts` (one server for the module), through `slime_corr.main.main` (in this process:
no second start-up of the imports): once with
`--use-rollout-routing-replay` (R3) and once with `--log-routing-mismatch` only. Both finish their steps and log
the routing mismatch of the fp32 trainer's own router against the bf16 engine's (> 0); without replay the tokens
routed differently carry a much larger log-prob mismatch than the others, with replay (the trainer computes them
with the engine's experts) they do not."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from slime_corr.models.selection import TINY_MOE
from tests.real_sglang.sglang_helpers import ServerSpec

pytestmark = pytest.mark.cost(70)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

RUN = ["--model", TINY_MOE, "--num-rollout", "1", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
       "--num-steps-per-rollout", "1", "--micro-batch-size", "8", "--rollout-max-response-len", "16",
       "--rollout-correction-preset", "decoupled_token_is"]


@pytest.fixture(scope="module")
def server(launch, tiny_moe_cache):
    (s,) = launch(ServerSpec(str(Path(tiny_moe_cache) / TINY_MOE), dtype="bfloat16",
                             extra_args=("--enable-return-routed-experts",), name="moe-bf16"))
    return s.url


def _run(url: str, tiny_moe_cache: str, run_dir: Path, *flags: str) -> dict:
    from slime_corr.main import main

    start = time.perf_counter()
    assert main([*RUN, "--model-cache-dir", tiny_moe_cache, "--sglang-url", url, "--run-dir", str(run_dir), *flags]) == 0
    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print(f"{flags}: {time.perf_counter() - start:.1f}s", {k: round(v, 2) for k, v in row.items()
                                                          if k.startswith("perf/")})
    return row


def test_routing_replay_in_the_main_job(server, tiny_moe_cache, tmp_path):
    keys = ("diag/routing_mismatch_frac", "diag/routing_mismatch_token_frac", "diag/logprob_abs_diff_routing_diff",
            "diag/logprob_abs_diff_routing_same", "rollout_corr/train_rollout_logprob_abs_diff")
    plain = _run(server, tiny_moe_cache, tmp_path / "plain", "--log-routing-mismatch")
    replay = _run(server, tiny_moe_cache, tmp_path / "replay", "--use-rollout-routing-replay")
    for name, row in (("log-routing-mismatch", plain), ("replay", replay)):
        print(name, {k: round(row[k], 5) for k in keys})
        assert row["rollout/trained_samples"] == 16 and row["train/grad_norm"] > 0
        assert 0 < row["diag/routing_mismatch_frac"] < 0.3  # bf16 engine vs fp32 trainer: some decisions differ
    assert plain["diag/logprob_abs_diff_routing_diff"] > 3 * plain["diag/logprob_abs_diff_routing_same"]
    assert replay["diag/logprob_abs_diff_routing_diff"] < 0.5 * plain["diag/logprob_abs_diff_routing_diff"]
