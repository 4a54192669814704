"""`slime_corr.device`, the one owner of the device and the backend: its rule (auto, `--device`,
`$SLIME_CORR_DEVICE`, LOCAL_RANK), the readers' derived choices (weight-sync backend, collective device, SGLang's
device), the micro-batch move, the flag, and that no other module decides (a scan of the package's source)."""

from __future__ import annotations

import re
from pathlib import Path
from unittest import mock

import pytest
import torch

from slime_corr import device
from slime_corr.config import ConfigError
from slime_corr.device_check import DeviceCheck
from slime_corr.main import main
from slime_corr.trainer.config import TrainerConfig

PACKAGE = Path(__file__).resolve().parents[1] / "slime_corr"


@pytest.fixture
def no_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither `$SLIME_CORR_DEVICE` nor LOCAL_RANK set (the suite pins the env var to cpu: tests/conftest.py)."""
    monkeypatch.delenv(device.DEVICE_ENV, raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)


def _gpus(count: int):  # noqa: ANN202 - a patch
    """torch as if it saw `count` GPUs (no CUDA call is made by `resolve`)."""
    return mock.patch.multiple(torch.cuda, is_available=lambda: count > 0, device_count=lambda: count)


def test_auto_is_cuda_local_rank_with_nccl_when_there_is_a_gpu_else_cpu_with_gloo(no_choice, monkeypatch) -> None:
    with _gpus(0):
        assert device.resolve() == device.Placement(torch.device("cpu"), "gloo")
        assert device.resolve("auto").needs_cpu_compat and device.resolve().cpu_initialization
    with _gpus(4):
        assert device.resolve() == device.Placement(torch.device("cuda", 0), "nccl")
        monkeypatch.setenv("LOCAL_RANK", "3")
        placement = device.resolve("auto")
        assert placement == device.Placement(torch.device("cuda", 3), "nccl")
        assert not placement.needs_cpu_compat and not placement.cpu_initialization
        assert device.resolve("cpu") == device.Placement(torch.device("cpu"), "gloo")  # the override wins
        monkeypatch.setenv("LOCAL_RANK", "4")
        with pytest.raises(device.DeviceError, match="LOCAL_RANK 4: this machine has 4 GPU"):
            device.resolve()


def test_the_flag_wins_over_the_env_var_and_bad_choices_are_named(no_choice, monkeypatch) -> None:
    monkeypatch.setenv(device.DEVICE_ENV, "cpu")
    with _gpus(2):
        assert device.resolve().device.type == "cpu" and device.resolve("cuda").device == torch.device("cuda", 0)
    monkeypatch.setenv(device.DEVICE_ENV, "tpu")
    with pytest.raises(device.DeviceError, match=r"\$SLIME_CORR_DEVICE=tpu is not one of auto, cpu, cuda"):
        device.resolve()
    with _gpus(0), pytest.raises(device.DeviceError, match="--device cuda: torch .* sees no GPU"):
        device.resolve("cuda")


def test_setup_sets_the_cuda_device_once_and_current_keeps_it(no_choice, monkeypatch) -> None:
    monkeypatch.setattr(device, "_current", None)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with _gpus(2), mock.patch.object(torch.cuda, "set_device") as set_device:
        placement = device.current()  # first use decides
        assert placement.device == torch.device("cuda", 1) and device.current() is placement
        set_device.assert_called_once_with(torch.device("cuda", 1))
    monkeypatch.setattr(device, "_current", None)
    with mock.patch.object(torch.cuda, "set_device") as set_device:
        assert device.setup("cpu").backend == "gloo"
        set_device.assert_not_called()


def test_readers_derive_their_choices_from_the_placement() -> None:
    with device.use("cuda"):  # a stand-in: sets no CUDA device
        assert device.weight_sync_backend(engines_share_device=False) == "nccl"
        assert device.weight_sync_backend(engines_share_device=True) == "gloo"  # NCCL: one rank per GPU
        assert device.collective_device("nccl").type == "cuda" and device.collective_device("gloo").type == "cpu"
        assert device.engine_device() == "cuda"
    with device.use("cpu"):
        assert device.weight_sync_backend(engines_share_device=False) == "gloo" and device.engine_device() == "cpu"
    with device.use("meta", backend="nccl") as placement:
        assert placement.backend == "nccl" and device.collective_device("nccl").type == "meta"


def test_micro_batches_move_in_place_once_and_stay_as_they_are_on_the_cpu() -> None:
    batch = {"tokens": torch.arange(6).reshape(2, 3), "loss_mask": torch.ones(2, 3), "prox_lag": torch.tensor(1),
             "note": "kept"}
    before = dict(batch)
    with device.use("cpu"):
        assert device.to_device(batch) is batch and all(batch[k] is v for k, v in before.items())  # no copy
    with device.use("meta"), DeviceCheck("meta") as check:
        assert device.to_device(batch) is batch
        device.to_device(batch)  # already there: nothing more moves
    assert {v.device.type for v in batch.values() if isinstance(v, torch.Tensor)} == {"meta"}
    assert batch["note"] == "kept" and len(check.problems) == 3  # one copy per tensor, from the CPU


def test_modules_are_placed_on_the_chosen_device() -> None:
    with device.use("meta"):
        module = device.place_module(torch.nn.Linear(2, 2))
    assert {p.device.type for p in module.parameters()} == {"meta"}


def test_the_device_flag_and_the_env_var_are_checked_at_parse_time(monkeypatch, capsys) -> None:
    assert TrainerConfig(device="cpu").device == "cpu" and TrainerConfig().device is None
    with _gpus(0), pytest.raises(ConfigError, match="--device cuda: torch .* sees no GPU"):
        TrainerConfig(device="cuda")
    assert main(["--device", "cpu", "--self-check"]) == 0
    monkeypatch.setenv(device.DEVICE_ENV, "tpu")
    with pytest.raises(SystemExit) as e:
        main(["--self-check"])
    assert e.value.code == 2 and "$SLIME_CORR_DEVICE=tpu is not one of auto, cpu, cuda" in capsys.readouterr().err


# Calls that decide a device or a backend; only slime_corr/device.py may make them (cpu_compat replaces
# `torch.cuda.current_device` by assignment, which the pattern does not match).
_DECISIONS = re.compile(r"torch\.cuda\.(is_available|current_device|set_device|device_count)\(|"
                        r"init_process_group\(\s*[\"'](gloo|nccl)[\"']|use_cpu_initialization=not")


def test_no_module_but_device_py_decides_the_device() -> None:
    found = [f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}"
             for path in sorted(PACKAGE.rglob("*.py")) if path.name != "device.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if _DECISIONS.search(line)]
    assert not found, "decided outside slime_corr/device.py:\n" + "\n".join(found)
