"""The config's checks one at a time: each is a function of the config (`slime_corr.config_checks`), so it can be
tried alone on an object that holds only what it reads; the choices come from the fields' `Literal` types."""

import typing
from types import SimpleNamespace

import pytest

from slime_corr import config_checks
from slime_corr.config import FIELD_KINDS, ConfigError, RolloutCorrectionConfig
from slime_corr.trainer import config_checks as trainer_checks


def test_a_check_runs_alone_on_what_it_reads():
    rs = SimpleNamespace(use_rs=True, rs_upper_bound=None, rs_lower_bound=None)
    with pytest.raises(ConfigError, match="--use-rs needs --rs-upper-bound"):
        config_checks.check_rs_switch(rs)
    config_checks.check_rs_switch(SimpleNamespace(use_rs=False, rs_upper_bound=None, rs_lower_bound=None))
    loss = {name: None for name in ("eps_clip_high", "eps_clip_c")}
    with pytest.raises(ConfigError, match=r"--eps-clip=1.5 must be in \(0, 1\)\."):
        config_checks.check_loss(SimpleNamespace(loss_type="ppo", use_rollout_logprobs=False, use_tis=False,
                                                 eps_clip=1.5, opsm_delta=0.0, policy_ratio_level="token", **loss))


def test_the_config_runs_every_check_in_order():
    assert config_checks.CHECKS[0] is config_checks.check_choices and len(set(config_checks.CHECKS)) == 9
    with pytest.raises(ConfigError, match="--tis-mode='x' is not one of truncate, clip, mask."):
        RolloutCorrectionConfig(tis_mode="x", use_rs=True)  # the choices first, then the RS switch


def test_the_choices_and_kinds_come_from_the_annotations():
    hints = typing.get_type_hints(RolloutCorrectionConfig)
    for name, choices in config_checks.CHOICES.items():
        literal = [a for a in typing.get_args(hints[name]) if a is not type(None)]
        assert choices == (typing.get_args(literal[0]) if name == "rs_agg" else tuple(literal)), name
    assert FIELD_KINDS["use_tis"] == "bool" and FIELD_KINDS["tis_mode"] == "str" and FIELD_KINDS["rs_agg"] == "str?"
    assert FIELD_KINDS["eps_clip"] == "float" and FIELD_KINDS["tis_upper_bound"] == "float?"
    assert FIELD_KINDS["custom_config_path"] == "str?"


def test_a_trainer_check_runs_alone_on_what_it_reads():
    """The trainer's checks are functions of its config too (`slime_corr.trainer.config_checks`)."""
    addresses = {"rollout_weight_sync": "disk", "sglang_url": (), "rollout_engine": "sglang", "work_dir": None}
    with pytest.raises(ConfigError, match="--update-weight-master-address '10.0.0.1' is only used by"):
        trainer_checks.check_addresses(SimpleNamespace(update_weight_master_address="10.0.0.1", **addresses))
    trainer_checks.check_addresses(SimpleNamespace(update_weight_master_address=None, **addresses))
