"""The main job under faults: each ends with its exit code, a message that names the cause and the fix, within a
bound (issue 22's probe table). Servers are fault servers on 127.0.0.1 (tests/rollout/fault_server.py); the jobs
run as real processes, a few at a time.

Time bounds: the waits are scaled down by flags (`--rollout-request-timeout 1`, health checks every 1 s) and the
bound is that wait plus start-up on a loaded 2-core machine. With the default flags the same paths are bounded by
4 attempts × `--rollout-request-timeout` 60 s + backoff and aborts (≈ 4.3 min) for a server that accepts requests
and never answers, and by `--rollout-health-check-interval` + `--rollout-health-check-timeout` (30 + 30 s) for
one that stops answering its health check too.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.job_runner import MainJob, run_main_job
from tests.rollout.fault_server import run_fault_server

pytestmark = pytest.mark.cost(160)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

# the faults here are in a fault server, the router, the trainer or its checkpoints, not in the engine: the jobs that
# start engines start embedded ones (tests/real_sglang kills a real SGLang server mid-run)
TINY = ["--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "4", "--rollout-progress", "none", "--rollout-engine", "embedded"]
PARALLEL = 3  # jobs at once
JOB_LIMIT = 400.0  # seconds a job may take in all (imports and start-up on a loaded 2-core machine included)
READY = re.compile(r"^(SGLang at|embedded engines)", re.M)  # the engines are up: what a bound is measured from
BOUND = 45.0  # seconds from READY to the exit, for the faults found at once (a loaded machine: 4 steps take ~10 s)


@dataclass
class Case:
    name: str
    flags: list[str]
    rc: int
    message: str  # a regex the output must match
    bound: float  # seconds from READY to the exit
    mode: str | None = None  # a fault server with this mode, passed as --sglang-url
    interrupt_on: str | None = None  # SIGINT once the output has this text
    interrupt_group: bool = False  # ... to the job's process group, its engines too, as a terminal's Ctrl-C
    kill_child_after_step: str | None = None  # SIGKILL the job's child process of this name once "step 1:" is out
    absent: list[str] = field(default_factory=list)  # regexes the output must not match
    result: dict = field(default_factory=dict)


def _launch(case: Case, tmp: Path) -> None:
    """Run `case` to its end (in a thread): rc, output, and seconds from the job's first line after start-up
    (READY, or its exit for a job that stops at parse time) land in case.result."""
    out_path = tmp / f"{case.name}.out"
    with contextlib.ExitStack() as server:
        run_dir = [] if "--run-dir" in case.flags else ["--run-dir", str(tmp / "runs" / case.name)]
        args = [*TINY, *run_dir, *case.flags]
        if case.mode is not None:
            url, _ = server.enter_context(run_fault_server(mode=case.mode))
            args += ["--sglang-url", url]
        args = [c.replace("{tmp}", str(tmp)).replace("{name}", case.name) for c in args]
        start = time.monotonic()
        # the job's process runs the entry point forked from tests/job_runner.py's server (no interpreter start-up);
        # SIGINT is handled as in a fresh interpreter, and `interrupt_group` makes it a process group's leader, as
        # a terminal's foreground job
        proc = MainJob(args, cwd=Path(__file__).parents[2], stdout=out_path,
                       new_process_group=case.interrupt_group)
        ready = None
        interrupted = False
        while proc.poll() is None and time.monotonic() - start < JOB_LIMIT:
            text = out_path.read_text()
            if ready is None and READY.search(text):
                ready = time.monotonic()
            if case.interrupt_on and not interrupted and case.interrupt_on in text:
                if case.interrupt_group:
                    os.killpg(proc.pid, signal.SIGINT)
                else:
                    proc.send_signal(signal.SIGINT)
                interrupted = True
            if case.kill_child_after_step and not interrupted and "step 1:" in text:
                interrupted = _kill_child(proc.pid, case.kill_child_after_step)
            time.sleep(0.1)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    end = time.monotonic()
    case.result.update(rc=proc.returncode, seconds=end - (ready or end), output=out_path.read_text())


def _kill_child(pid: int, name: str) -> bool:
    """SIGKILL the child of `pid` whose command line contains `name`; True when one was found."""
    for child in Path("/proc").glob("[0-9]*"):
        try:
            stat = (child / "stat").read_text()
            cmdline = (child / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and name in (cmdline + stat):
            os.kill(int(child.name), signal.SIGKILL)
            return True
    return False


def _run_all(cases: list[Case], tmp: Path) -> None:
    cases = sorted(cases, key=lambda c: c.name)
    for i in range(0, len(cases), PARALLEL):
        threads = [threading.Thread(target=_launch, args=(c, tmp)) for c in cases[i:i + PARALLEL]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def _check(cases: list[Case]) -> None:
    failures = []
    for c in cases:
        r = c.result
        out = r.get("output", "")
        bad = []
        if r.get("rc") != c.rc:
            bad.append(f"exit {r.get('rc')} (expected {c.rc})")
        if not re.search(c.message, out, re.S):
            bad.append(f"no match for {c.message!r}")
        if r.get("seconds", 1e9) > c.bound:
            bad.append(f"took {r.get('seconds'):.0f} s > {c.bound:.0f} s")
        for pattern in ["Traceback", "Task was destroyed", "Unclosed", "Error handling request", *c.absent]:
            if re.search(pattern, out):
                bad.append(f"output has {pattern!r}")
        print(f"{c.name}: exit {r.get('rc')}, {r.get('seconds', 0):.1f} s, "
              f"{(re.search(c.message, out, re.S) or [''])[0][:160]!r}")
        if bad:
            failures.append(f"{c.name}: {'; '.join(bad)}\n{out[-2500:]}")
    assert not failures, "\n\n".join(failures)


SERVER_CASES = [
    Case("non_json", [], 1, r"rollout 0: \d of 4 samples failed.*bad response @ http://127\.0\.0\.1:\d+: e\.g\. "
         r".*What to check:.*is it an SGLang server", BOUND, mode="non_json"),
    Case("wrong_shape", [], 1, r"samples failed.*bad response @ http://127\.0\.0\.1:\d+", BOUND, mode="wrong_shape"),
    Case("http500", [], 1, r"samples failed.*HTTP 5xx @ http://127\.0\.0\.1:\d+.*its log", BOUND, mode="http500"),
    Case("generate_never_answers", ["--rollout-request-timeout", "1"], 1,
         r"samples failed.*timeout @ http://127\.0\.0\.1:\d+.*stuck or overloaded", BOUND + 30,
         mode="hang_generate"),
    Case("server_stops_answering", ["--rollout-health-check-interval", "1", "--rollout-health-check-timeout", "1"], 1,
         r"no rollout engine is left: http://127\.0\.0\.1:\d+: no answer to its health check within 1 s", BOUND + 20,
         mode="silent"),
    Case("server_killed_mid_run", [], 1, r"step 2: .*rollout 1: \d of 4 samples failed.*connection refused @ "
         r"http://127\.0\.0\.1:\d+.*still running", BOUND, mode="ok_then_die"),
    Case("weight_update_not_sglang", [], 1, r"error: /update_weights_from_disk failed on 1 of 1 worker\(s\): "
         r"http://127\.0\.0\.1:\d+: HTTP 200 without SGLang's answer \{\"success\": true, \.\.\.\} \(got "
         r"'<html>OK</html>'\): the update is not known to have been applied", BOUND, mode="update_not_json"),
    Case("weight_update_not_applied", [], 1, r"error: /update_weights_from_disk failed on 1 of 1 worker\(s\): "
         r"http://127\.0\.0\.1:\d+: answered success, but then reports weight version 'fault', not 'step-0': the "
         r"server did not apply the update", BOUND, mode="update_ignored"),
    Case("control_posts_never_answer", ["--rollout-control-timeout", "2"], 1,
         r"error: /pause_generation failed on 1 of 1 worker\(s\): http://127\.0\.0\.1:\d+: no answer within 2 s though "
         r"its health check answers \(.*--rollout-control-timeout\)", BOUND, mode="posts_hang"),
    Case("all_failed_allowed", ["--max-failed-sample-fraction", "1", "--rollout-correction-preset",
                                "decoupled_seq_is_rs", "--run-dir", "{tmp}/{name}"], 0,
         r"step 1: trained=0 failed=2 step_time=\S+\nstep 2: trained=0 failed=2 step_time", BOUND,
         mode="non_json", absent=["mismatch_k3_kl", "reward="]),
    Case("ok", ["--rollout-correction-preset", "decoupled_seq_is_rs", "--no-engine-agreement-check"], 0,
         r"step 2: trained=2 failed=0 reward=\S+ loss=.*mismatch_k3_kl", BOUND, mode="ok",
         absent=["staleness="]),
    # the fault server's log-probs are not the trainer's model's: another model, as far as the trainer can tell
    Case("engine_serves_another_model", ["--rollout-correction-preset", "decoupled_seq_is_rs"], 1,
         r"step 1: trained=2 .*\nslime_corr\.main: error: step 1: the engine's log-probs and the trainer's disagree at "
         r"the same weights: mean \|lp_train - lp_rollout\| = \S+ nats, above the 0\.25 that an engine in bfloat16 and "
         r"a trainer in float32 explain\. Likely causes: .*--no-engine-agreement-check runs anyway\.\s*\Z", BOUND,
         mode="ok"),
    Case("router_killed_engines_take_over", ["--rollout-num-engines", "2", "--rollout-router", "on", "--num-rollout",
                                             "4"], 0,
         r"rollout \d: truncated=4 retried_samples=\d+ failovers=\d+ dead_engines=\['http://127\.0\.0\.1:\d+'\]"
         r".*step 8: trained=2 failed=0", BOUND, kill_child_after_step="router"),
    Case("ctrl_c", ["--num-rollout", "50", "--save", "{tmp}/ctrl_c_ckpt", "--save-interval", "1"], 130,
         r"slime_corr\.main: interrupted after rollout \d+ of 50 \(step \d+\); last checkpoint \S+iter_\d+; resume: "
         r"the same command with --load \S+ctrl_c_ckpt\.\s*\Z", BOUND + 30, interrupt_on="checkpoint:"),
    # a terminal's Ctrl-C reaches every process of the job: the engine, and Megatron's checkpoint writers (the
    # first save, which starts them, takes seconds: the signal lands in it). The save completes, then the job ends.
    Case("ctrl_c_terminal", ["--num-rollout", "50", "--save", "{tmp}/ctrl_c_terminal_ckpt", "--save-interval", "2"],
         130, r"\nslime_corr\.main: interrupted after rollout \d+ of 50 \(step \d+\); "
         r"(last checkpoint \S+iter_\d+|no checkpoint saved yet)[^\n]*\.\s*\Z", BOUND + 30, interrupt_on="step 4:",
         interrupt_group=True),
]


def test_rollout_faults_stop_the_run_with_a_named_error_in_bounded_time(tmp_path):
    cases = [c for c in SERVER_CASES if c.kill_child_after_step != "router" or importlib.util.find_spec("sglang_router")]
    _run_all(cases, tmp_path)
    _check(cases)
    records = [json.loads(line) for line in (tmp_path / "all_failed_allowed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/failed_samples"] for r in records] == [2, 2, 2, 2]
    assert not [k for r in records for k in r if k.startswith(("rollout_corr/", "train/", "diag/"))]
    report = subprocess.run([sys.executable, "-m", "slime_corr.cli", "report", str(tmp_path / "all_failed_allowed")],
                            capture_output=True, text=True, timeout=300)
    assert report.returncode == 0 and "no recommendation" in report.stdout, report.stdout + report.stderr
    assert "negligible" not in report.stdout  # steps that trained nothing are no evidence


def test_paths_and_checkpoints_fail_with_one_message(tmp_path, capsys):
    from slime_corr.main import parse_run_config

    ckpt = tmp_path / "ckpt"
    proc = run_main_job([*TINY, "--num-rollout", "1", "--save", str(ckpt), "--run-dir", str(tmp_path / "saved_run")],
                        timeout=300, output_dir=tmp_path / "saved_output")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    # the step lines of the saved rollout come before its checkpoint line
    assert proc.stdout.index("step 2:") < proc.stdout.index("checkpoint:")
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "metrics.jsonl").write_text('{"step": 1}\n')
    damaged = {}
    for name in ("distcp", "common", "metadata", "tracker", "model_size"):
        shutil.copytree(ckpt, tmp_path / name)
        damaged[name] = tmp_path / name
    it = next((tmp_path / "distcp").glob("iter_*"))
    distcp = sorted(it.glob("*.distcp"))[0]
    distcp.write_bytes(distcp.read_bytes()[: distcp.stat().st_size // 2])
    common = next((tmp_path / "common").glob("iter_*")) / "common.pt"
    common.write_bytes(common.read_bytes()[: common.stat().st_size // 2])
    (next((tmp_path / "metadata").glob("iter_*")) / "metadata.json").write_text("garbage{")
    (tmp_path / "tracker" / "latest_checkpointed_iteration.txt").write_text("eight\n")
    parse_time = [  # refused while parsing (exit 2): in this process, no start-up to pay
        (["--save", f"{tmp_path}/a_file/ckpt"], r"--save \S+a_file/ckpt: \S+a_file is a file, so the directory cannot"),
        (["--run-dir", "/proc/slime_corr_run"],
         r"--run-dir /proc/slime_corr_run: cannot write there \(it would be created in /proc\)"),
        (["--work-dir", f"{tmp_path}/a_file/w"], r"--work-dir \S+: \S+a_file is a file"),
        (["--run-dir", f"{tmp_path}/used"], r"--run-dir \S+used already holds a run's metrics\.jsonl: a run never "
                                            r"appends to another run's metrics\. Pass a new --run-dir"),
        (["--load", f"{tmp_path}/tracker"], r"latest_checkpointed_iteration\.txt: expected an iteration number, got "
                                            r"'eight': write the number of a complete iter_\* directory"),
        (["--load", str(ckpt), "--run-dir", f"{tmp_path}/used"],
         r"--run-dir \S+used holds the metrics of another run \(its run_config\.json names the checkpoints of no run, "
         r"and this run resumes from --load \S+ckpt\): a run never appends to another run's metrics"),
    ]
    for flags, message in parse_time:
        with pytest.raises(SystemExit) as exit_info:
            parse_run_config(flags, check_urls=False)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and re.search(message, err), (flags, err[-600:])
        print(f"{flags[0]}: exit 2 at parse time: {err.strip().splitlines()[-1][:160]!r}")
    parse_run_config(["--load", str(ckpt), "--run-dir", str(tmp_path / "saved_run")], check_urls=False)  # its own
    cases = [
        Case("distcp_truncated", ["--load", "{tmp}/distcp", "--num-rollout", "2"], 1,
             r"error: --load \S+distcp: \S+\.distcp is truncated: \d+ bytes, its index needs \d+\. The checkpoint is "
             r"damaged.*--ckpt-step N", BOUND),
        Case("common_pt_truncated", ["--load", "{tmp}/common", "--num-rollout", "2"], 1,
             r"error: --load \S+common: \S+common\.pt cannot be read", BOUND),
        Case("metadata_garbage", ["--load", "{tmp}/metadata", "--num-rollout", "2"], 1,
             r"error: --load \S+metadata: \S+metadata\.json is not valid JSON", BOUND),
        Case("other_model_size", ["--load", "{tmp}/model_size", "--num-rollout", "2", "--hidden-size", "32"], 1,
             r"error: --load \S+model_size: iter_\d+ holds another model than this run builds \(.*shape mismatch.*\)"
             r"\. Resume with the model flags", BOUND),
    ]
    _run_all(cases, tmp_path)
    _check(cases)


def test_a_silent_driver_and_a_stuck_collective_end_in_the_distributed_timeout():
    from tests.trainer.watchdog_ranks import run_watchdog_ranks

    results = run_watchdog_ranks(timeout_s=3.0)
    assert re.search(r"rank 0 \(the rollout driver\) showed no sign of life for 0\.05 min while generating rollout 0 "
                     r"\(--distributed-timeout-minutes\)", results["silent_driver"]), results
    assert re.search(r"a collective with the other ranks timed out after --distributed-timeout-minutes 0\.05",
                     results["stuck_collective"]), results
    assert re.search(r"rank 0 \(the rollout driver\) showed no sign of life for 0\.05 min while generating rollout 2 ",
                     results["stopped_driver"]), results
    assert results["driver_error"] == "rollout 0: 4 of 4 samples failed", results
    assert max(results["seconds"]) < 60, results


@pytest.mark.parametrize("world", ["no process group", "one gloo process"])
def test_the_beacon_is_a_no_op_in_a_world_of_one(world):
    """Without torch.distributed, or in a group of one process, the beacon has no store and no beat thread: publish
    and wait return at once."""
    import torch.distributed as dist

    from slime_corr.ports import init_world_of_one
    from slime_corr.trainer.watchdog import DriverBeacon

    if world == "one gloo process":
        init_world_of_one("gloo")  # an in-process store: no port
    try:
        assert dist.is_initialized() == (world == "one gloo process")
        beacon = DriverBeacon(1.0)
        assert beacon.store is None and beacon._thread is None
        beacon.publish("rollout/0")
        beacon.wait("rollout/0", "anything")
        beacon.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_router_on_without_sglang_router_is_refused_at_parse_time(monkeypatch, capsys):
    from slime_corr.main import parse_run_config

    # the dev environment has sglang-router: its absence is simulated (no other way to have it missing here)
    monkeypatch.setattr("slime_corr.trainer.config.router_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        parse_run_config(["--rollout-router", "on", "--rollout-engine", "embedded"], check_urls=False)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--rollout-router on: sglang-router is not installed here" in err, err


CUSTOM_FUNCTIONS = '''
def returns_a_tuple(inputs, config):
    return inputs.log_ratio.exp(), inputs.loss_mask

def raises(inputs, config):
    return {}["weights"]  # the user's own bug
'''


def test_a_custom_weighting_function_that_fails_is_named_in_one_line(tmp_path):
    (tmp_path / "custom.py").write_text(CUSTOM_FUNCTIONS)
    flags = ["--rollout-correction-preset", "decoupled_token_is", "--custom-tis-function-path"]
    cases = [
        Case("custom_returns_a_tuple", [*flags, "{tmp}/custom.py:returns_a_tuple"], 1,
             r"\nslime_corr\.main: error: --custom-tis-function-path \S+custom\.py:returns_a_tuple returned tuple"
             r".*it must return slime_corr\.correction\.WeightOutputs\(weights=\.\.\., loss_mask=\.\.\.\) \(see "
             r"examples/custom_tis\.py\)\.\s*\Z", BOUND),
        Case("custom_raises", [*flags, "{tmp}/custom.py:raises"], 1,
             r"\nslime_corr\.main: error: --custom-tis-function-path \S+custom\.py:raises raised KeyError: 'weights' "
             r"\(its traceback: --custom-function-traceback\)\s*\Z", BOUND),
        Case("custom_raises_traceback", [*flags, "{tmp}/custom.py:raises", "--custom-function-traceback"], 1,
             r"\nslime_corr\.main: error: --custom-tis-function-path \S+custom\.py:raises raised KeyError: 'weights'\n"
             r"Traceback \(most recent call last\):\n.*custom\.py\", line 6, in raises\n.*KeyError: 'weights'\s*\Z",
             BOUND),
    ]
    _run_all(cases, tmp_path)
    for case in cases[2:]:  # the traceback asked for is the user's own
        case.result["output"] = case.result["output"].replace("Traceback (most recent call last)", "Its traceback")
        case.message = case.message.replace(r"Traceback \(most recent call last\)", "Its traceback")
    _check(cases)
