"""End to end: ONE short run of the main job (module fixture) with every sink on, then what it wrote.

The run: decoupled PPO with sequence IS (truncate), sequence RS, the veto and batch normalization, so every
SPEC.md metric of that mode is produced; asynchronous, two optimizer steps per rollout, so the samples are stale
(weight lags 0, 1, then 2, 3) and π_θ leaves π_old within a rollout (the drift split); TensorBoard and W&B
(offline) on; run under strace when the machine has it, to check that nothing but loopback is contacted.
"""

from __future__ import annotations

import codecs
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.cost(22)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
ROLLOUTS, STEPS_PER_ROLLOUT = 2, 2
STEPS = ROLLOUTS * STEPS_PER_ROLLOUT
SPEC_METRICS = (
    "mismatch_kl", "mismatch_k3_kl", "mismatch_training_log_ppl", "mismatch_rollout_log_ppl",
    "mismatch_training_ppl", "mismatch_rollout_ppl", "mismatch_log_ppl_diff", "mismatch_log_ppl_abs_diff",
    "mismatch_ppl_ratio", "mismatch_chi2_token", "mismatch_chi2_seq", "train_rollout_logprob_abs_diff",
    "rollout_probs_diff_max", "rollout_probs_diff_mean", "rollout_probs_diff_std",
    "rollout_actor_probs_pearson_corr", "ois", "mis_ess", "mis_weight_p10", "mis_weight_p50", "mis_weight_p90",
    "mis_weight_p99", "mis_weight_min", "mis_weight_max", "mis_weight_std", "mis_mean_is_weight_before_clip",
    "mis_truncate_fraction", "mis_ratio_mean_after_mis", "mis_batch_norm_factor", "mis_rs_rejected_token_fraction",
    "mis_rs_rejected_seq_fraction", "mis_catastrophic_token_fraction", "mis_catastrophic_seq_fraction",
    "mis_rejected_token_fraction", "mis_rejected_seq_fraction", "mis_contributing_token_count",
    "mis_all_rejected", "mis_valid_token_count", "mis_valid_seq_count", "mis_nonfinite_token_count",
    "mis_nonfinite_seq_count", "mis_nonfinite_seq_fraction",
)
OTHER_METRICS = ("train/loss", "train/pg_clipfrac", "train/ppo_kl", "train/grad_norm", "rollout/reward_mean",
                 "rollout/samples", "perf/step_time", "diag/tokens", "diag/drift/mismatch_share")


def _strace_works() -> bool:
    if shutil.which("strace") is None:
        return False
    probe = subprocess.run(["strace", "--seccomp-bpf", "-f", "-qq", "-e", "trace=connect", "-o", "/dev/null", "true"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("monitored")
    cmd = [sys.executable, "-m", "slime_corr.cli", "--num-rollout", str(ROLLOUTS), "--num-steps-per-rollout",
           str(STEPS_PER_ROLLOUT), "--async-rollout", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
           "--micro-batch-size", "4",
           "--rollout-max-response-len", "8", "--rollout-correction-preset",
           "decoupled_seq_is_rs", "--rs-veto-threshold", "1e-4", "--tis-batch-normalize", "--work-dir", str(d / "run"),
           "--tensorboard-dir", str(d / "tb"), "--wandb-project", "slime-corr-test", "--wandb-mode", "offline",
           "--rollout-engine", "embedded"]
    traced = _strace_works()
    if traced:
        cmd = ["strace", "--seccomp-bpf", "-f", "-qq", "-s", "512", "-e", "trace=connect,sendto,sendmmsg", "-o",
               str(d / "strace.log"), *cmd]
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_CONFIG_DIR=str(d / "wandb-config"), WANDB_CACHE_DIR=str(d / "wandb-cache"),
               WANDB_DATA_DIR=str(d / "wandb-data"))  # nothing written outside the test's folder
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (d / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"dir": d, "proc": proc, "records": records, "traced": traced}


def test_jsonl_has_every_spec_metric_finite_each_step(run):
    records = run["records"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        missing = [k for k in SPEC_METRICS if f"rollout_corr/{k}" not in r] + [k for k in OTHER_METRICS if k not in r]
        assert not missing, missing
        bad = {k: v for k, v in r.items() if not (isinstance(v, int | float) and math.isfinite(v))}
        assert not bad, bad  # every value finite (a non-finite one would be null)
        assert r["rollout/samples"] == 8 and r["rollout_corr/mis_valid_seq_count"] == 4  # a rollout in 2 steps
        assert r["rollout_corr/mismatch_k3_kl"] > 0  # the bf16 engine vs the fp32 trainer: a real mismatch
    # rollout 1 was generated with the weights before rollout 0's two updates: far more mismatch than bf16 alone
    assert records[2]["rollout_corr/mismatch_k3_kl"] > 10 * records[0]["rollout_corr/mismatch_k3_kl"]


def test_diagnostics_agree_with_the_spec_metrics_of_the_same_step(run):
    for r in run["records"]:
        assert r["diag/tokens"] == r["rollout_corr/mis_valid_token_count"]
        buckets = [k[:-len("/k3")] for k in r if k.startswith("diag/prob/") and k.endswith("/k3")]
        k3 = sum(r[f"{b}/k3"] * r[f"{b}/token_frac"] for b in buckets)
        # the core sums fp32 log-probs in fp32 (k3 ~ x^2/2 loses ~1e-4 relative there), the diagnostics in fp64
        assert k3 == pytest.approx(r["rollout_corr/mismatch_k3_kl"], rel=1e-3)
        assert r["diag/drift/rollout_to_old_k3"] == pytest.approx(k3, rel=1e-9)
        # staleness by weight version: every token of a step has the step's lag (versions behind the trainer)
        lag = r["rollout/staleness_mean"]
        assert r[f"diag/lag/{lag:.0f}/token_frac"] == 1.0 and r["diag/lag/mean"] == lag
    assert [r["rollout/staleness_mean"] for r in run["records"]] == [0, 1, 2, 3]
    # the drift split: pi_theta = pi_old at a rollout's first step, then the update moves it
    first, second = run["records"][0::2], run["records"][1::2]
    assert all(r["diag/drift/old_to_current_k3"] == 0 for r in first)
    assert all(r["diag/drift/old_to_current_k3"] > 0 and r["train/ppo_kl"] != 0 for r in second)
    top = [json.loads(x) for x in (run["dir"] / "run" / "top_mismatch.jsonl").read_text().splitlines()]
    assert {t["step"] for t in top} == set(range(1, STEPS + 1))
    assert all(t["tokens"] > 0 and "response" in t and "prompt" in t for t in top)


def test_console_line_and_rollout_progress(run):
    out, err = run["proc"].stdout, run["proc"].stderr
    lines = re.findall(r"^step (\d+): trained=4 failed=0 reward=\S+ loss=\S+ pg_clipfrac=\S+ ppo_kl=\S+ "
                       r"grad_norm=\S+ staleness=\d step_time=\S+ mismatch_kl=\S+ mismatch_k3_kl=\S+", out, re.M)
    assert lines == [str(s) for s in range(1, STEPS + 1)], out
    # not a terminal: plain progress lines, the last one at 100 %
    assert re.search(r"^rollout 1: 8/8 samples \(100%\), \d+ tokens, [\d.]+ s$", err, re.M), err[-2000:]


def test_tensorboard_event_files_hold_every_metric(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run["dir"] / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    keys = set().union(*(set(r) - {"step", "time"} for r in run["records"]))
    assert keys <= tags, keys - tags
    for key in (f"rollout_corr/{k}" for k in SPEC_METRICS):
        got = [(e.step, e.value) for e in events.Scalars(key)]
        want = [(r["step"], pytest.approx(r[key], rel=1e-6, abs=1e-30)) for r in run["records"]]
        assert got == want, key


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B run file: a 7-byte header (":W&B", magic, version), then LevelDB-log blocks of
    32 KiB whose chunks (crc32, little-endian length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4) make records."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records


def test_wandb_offline_run_directory(run):
    from wandb.proto import wandb_internal_pb2

    runs = list((run["dir"] / "run" / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    files = list(runs[0].glob("run-*.wandb"))
    assert len(files) == 1
    history = []
    for raw in _wandb_records(files[0]):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    assert [h["_step"] for h in history] == list(range(1, STEPS + 1))
    for h, r in zip(history, run["records"], strict=True):
        for key in (f"rollout_corr/{k}" for k in SPEC_METRICS):
            assert h[key] == pytest.approx(r[key], rel=1e-12), key


def _dns_name(packet: bytes) -> str:
    labels, i = [], 12  # the question's name follows the 12-byte header
    while i < len(packet) and packet[i]:
        labels.append(packet[i + 1:i + 1 + packet[i]].decode("ascii", "replace"))
        i += 1 + packet[i]
    return ".".join(labels)


def test_nothing_but_loopback_is_contacted(run):
    if not run["traced"]:
        pytest.skip("strace is not available here: the network check needs it")
    loopback = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
    remote, names, dns_fds = [], set(), set()
    for line in (run["dir"] / "strace.log").read_text().splitlines():
        pid = line.split()[0]
        if "connect(" in line and "AF_INET" in line:
            addr = re.search(r'inet_addr\("([^"]+)"\)|inet_pton\(AF_INET6, "([^"]+)"', line)
            ip = addr.group(1) or addr.group(2)
            port = re.search(r"htons\((\d+)\)", line).group(1)
            fd = re.search(r"connect\((\d+),", line).group(1)
            if port == "53":  # a name lookup: judged by the name asked for, below
                dns_fds.add((pid, fd))
            elif ip not in loopback:
                remote.append(line)
        elif (m := re.search(r"send(?:to|mmsg)\((\d+),", line)) and (pid, m.group(1)) in dns_fds:
            for payload in re.findall(r'iov_base="((?:[^"\\]|\\.)*)"|sendto\(\d+, "((?:[^"\\]|\\.)*)"', line):
                names.add(_dns_name(codecs.escape_decode(payload[0] or payload[1])[0]))
    assert not remote, remote
    # torch.distributed's TCPStore asks for the name of 127.0.0.1 (a reverse lookup of loopback); nothing else
    assert names <= {"1.0.0.127.in-addr.arpa"}, names


def _report(run_dir: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "slime_corr.cli", "report", str(run_dir)],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = (run_dir / "report" / "summary.txt").read_text()
    assert summary in proc.stdout
    return summary


def test_report_command_makes_its_pngs_and_summary(run):
    from PIL import Image

    summary = _report(run["dir"] / "run")
    report = run["dir"] / "run" / "report"
    pngs = sorted(p.name for p in report.glob("*.png"))
    assert pngs == ["clipfrac.png", "diagnostics.png", "is_weights.png", "mismatch.png", "prob_buckets.png",
                    "rejection.png", "reward.png"]
    for name in pngs:
        with Image.open(report / name) as image:
            assert image.format == "PNG" and image.width >= 800 and image.height >= 300, name
    assert "thresholds: negligible: q < 0.001 <= moderate < 0.01 <= severe" in summary
    # the regime from the 90 % quantile of the logged k3 (numpy's, independent of the report's own quantile)
    p90 = float(np.quantile([r["rollout_corr/mismatch_k3_kl"] for r in run["records"]], 0.9))
    regime = "negligible" if p90 < 1e-3 else "moderate" if p90 < 1e-2 else "severe"
    assert f"p90 {p90:.3g}," in summary
    assert regime == "severe"  # the stale rollout (2 updates behind) dominates
    # sequence-level RS only while it is predicted to reject at most 30 % of the sequences
    share = float(re.search(r"sequence-level RS at this drift: about (\d+)% of the sequences", summary).group(1))
    preset = "decoupled_seq_is_rs" if share <= 30 else "decoupled_token_is"
    assert f"regime: severe -> recommended preset: {preset}" in summary
    assert "the rollout->old drift: every step (decoupled: lp_old vs lp_rollout)" in summary
    # async: a rollout's first step trains on samples 2 versions (one rollout's updates) behind pi_old
    assert "samples are stale (async rollout): a rollout's first step trains on samples up to 2.00 weight" in summary
    # the diagnostics: k3 per weight lag as the JSONL has it (each step holds one lag), the drift split
    by_lag = {int(r["rollout/staleness_mean"]): r for r in run["records"]}
    lags = ", ".join(f"{lag}: {r[f'diag/lag/{lag}/k3']:.3g}" for lag, r in by_lag.items())
    assert f"k3 per token by weight lag (versions): {lags}\n" in summary
    drift = np.mean([r["diag/drift/old_to_current_k3"] for r in run["records"]])
    assert f"old->current (the update) {drift:.3g}," in summary
    assert re.search(r"largest sequence mismatch: step \d, sum of log-ratios \S+ over \d+ tokens, response '", summary)


def test_report_on_the_synchronous_part_finds_the_bf16_mismatch_negligible(run, tmp_path):
    # the first rollout was sampled with the weights it starts training from: only bf16 vs fp32 differ
    part = tmp_path / "first_rollout"
    part.mkdir()
    lines = (run["dir"] / "run" / "metrics.jsonl").read_text().splitlines()[:STEPS_PER_ROLLOUT]
    (part / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    shutil.copy(run["dir"] / "run" / "run_config.json", part)
    from slime_corr.monitoring.report import main as report_main

    assert report_main([str(part)]) == 0  # in process: the command line was tested above
    summary = (part / "report" / "summary.txt").read_text()
    assert max(json.loads(x)["rollout_corr/mismatch_k3_kl"] for x in lines) < 1e-5  # bf16 alone, tiny model
    assert "regime: negligible -> recommended preset: ppo_is_bypass" in summary
    assert "this run used decoupled_seq_is_rs" in summary


def test_a_custom_functions_metrics_reach_the_jsonl_through_the_trainer(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "slime_corr.main", "--num-rollout", "1", "--num-steps-per-rollout", "1",
         "--rollout-batch-size", "1", "--n-samples-per-prompt", "4", "--micro-batch-size", "4",
         "--rollout-max-response-len", "4", "--use-tis", "--custom-tis-function-path",
         "examples/custom_tis.py:length_aware_geometric_is", "--work-dir", str(tmp_path),
         "--rollout-engine", "embedded"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # the function's own metric, under the correction prefix, beside the built-in ones
    assert 0 <= record["rollout_corr/custom_rejected_seq_fraction"] <= 1
    assert record["rollout_corr/mis_valid_seq_count"] == 4 and math.isfinite(record["train/loss"])


def test_the_console_script_is_the_dispatcher():
    # the fixture ran the main job and the report test the report through it (`python -m slime_corr.cli`)
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "slime-corr"]
    assert script.value == "slime_corr.cli:main"
