"""slime_corr's argparse extension on a host parser: slime's (its rollout-correction and loss flags restated from
slime/utils/arguments.py) and Megatron-LM's (megatron.training's parser when importable, else its relevant flags
restated from megatron/training/arguments.py)."""

from __future__ import annotations

import argparse
import os

import pytest

from slime_corr.arguments import add_loss_terms_args, add_rollout_correction_args, config_from_args
from slime_corr.config import ConfigError
from slime_corr.integrations.slime import config_from_slime_args
from slime_corr.loss_terms import LossTermsConfig

MIS_YAML = os.path.join(os.path.dirname(__file__), "mis.yaml")


def slime_parser() -> argparse.ArgumentParser:
    """slime's flags that meet slime_corr's, with slime's types, choices and defaults."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--eps-clip", type=float, default=0.2, help="PPO clip range")
    p.add_argument("--eps-clip-high", type=float, default=None, help="PPO clip upper range")
    p.add_argument("--eps-clip-c", type=float, default=None, help="lower bound of the value for Dual-clip PPO")
    p.add_argument("--kl-coef", type=float, default=0.00, help="KL penalty coefficient for reward shaping.")
    p.add_argument("--loss-type", type=str, choices=["policy_loss", "sft_loss", "custom_loss"],
                   default="policy_loss", help="Choose loss type")
    p.add_argument("--kl-loss-type", type=str, choices=["k1", "k2", "k3", "low_var_kl"], default="k1", help="KL")
    p.add_argument("--advantage-estimator", type=str, default="grpo",
                   choices=["grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"])
    p.add_argument("--use-kl-loss", action="store_true", default=False, help="whether to use KL loss from GRPO")
    p.add_argument("--kl-loss-coef", type=float, default=0.0, help="KL penalty coefficient for the loss function.")
    p.add_argument("--entropy-coef", type=float, default=0.0, help="Entropy loss coef")
    p.add_argument("--get-mismatch-metrics", action="store_true", default=False)
    p.add_argument("--use-rollout-logprobs", action="store_true", default=False)
    p.add_argument("--use-tis", action="store_true", default=False)
    p.add_argument("--tis-clip", type=float, default=2.0)
    p.add_argument("--tis-clip-low", type=float, default=0)
    p.add_argument("--custom-tis-function-path", type=str, default=None)
    p.add_argument("--custom-pg-loss-reducer-function-path", type=str, default=None)
    p.add_argument("--calculate-per-token-loss", action="store_true")
    p.add_argument("--custom-config-path", type=str, default=None)
    return p


def megatron_parser() -> argparse.ArgumentParser:
    """Megatron-LM's parser (`add_megatron_arguments`, megatron-core >= 0.19), else its flags that meet ours."""
    from slime_corr.mcore.compat import has_megatron_training, import_megatron_training

    try:
        if not has_megatron_training():
            raise ImportError("megatron.training")
        import_megatron_training()
        from megatron.training.arguments import add_megatron_arguments
    except ImportError:  # megatron-core < 0.19: the flags that matter here, restated
        p = argparse.ArgumentParser(allow_abbrev=False)
        p.add_argument("--micro-batch-size", type=int, default=None)
        p.add_argument("--seed", type=int, default=1234)
        p.add_argument("--lr", type=float, default=None)
        p.add_argument("--calculate-per-token-loss", action="store_true")
        p.add_argument("--grpo-kl-beta", type=float, default=0.001)
        p.add_argument("--grpo-entropy-term-weight", type=float, default=0.0)
        p.add_argument("--grpo-clamp-eps-lower", type=float, default=0.01)
        p.add_argument("--grpo-clamp-eps-upper", type=float, default=0.01)
        p.add_argument("--rl-inference-logprobs-is-correction", action="store_true")
        p.add_argument("--rl-importance-sampling-truncation-coef", type=float, default=None)
        return p
    return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


def extended(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    return add_rollout_correction_args(add_loss_terms_args(parser))


SLIME_SCRIPT = [  # lines of slime's run-qwen3-4b-mis.sh-style launch
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
    "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28", "--kl-coef", "0.00",
    "--loss-type", "policy_loss", "--use-tis",
    "--custom-tis-function-path", "slime_corr.integrations.slime.compute_mis_weights_with_cp",
    "--custom-config-path", MIS_YAML,
]


def test_extension_adds_only_what_slime_lacks():
    host = slime_parser()
    before = set(host._option_string_actions)
    parser = extended(host)
    added = set(parser._option_string_actions) - before
    assert {"--tis-mode", "--tis-level", "--use-rs", "--rs-upper-bound", "--rs-veto-threshold",
            "--tis-batch-normalize", "--policy-loss-type", "--rollout-correction-preset"} <= added
    assert not added & before  # nothing redefined
    assert "--loss-type" not in added  # slime's --loss-type stays slime's
    args = parser.parse_args(SLIME_SCRIPT)
    assert args.loss_type == "policy_loss" and args.kl_coef == 0.0 and args.policy_loss_type == "ppo"
    assert args.use_kl_loss and args.kl_loss_type == "low_var_kl"
    # the hook reads slime's args with slime's meaning (slime's YAML keys are put on args by slime)
    for k, v in {"tis_lower_bound": 0.5, "tis_upper_bound": 2.0, "use_rs": True, "rs_veto_threshold": 1e-4,
                 "tis_batch_normalize": True}.items():
        setattr(args, k, v)
    config, _ = config_from_slime_args(args)
    assert config.use_tis and config.use_rs and config.rs_bounds == (0.5, 2.0) and config.tis_batch_normalize
    # slime_corr's flags on slime's parser are read by the hook like YAML keys; at their defaults, slime's
    # --tis-clip / --tis-clip-low keep their meaning (slime's default TIS)
    config, _ = config_from_slime_args(parser.parse_args(["--use-tis", "--tis-clip", "1.5", "--tis-clip-low", "0.5"]))
    assert config.effective_tis_mode == "clip" and config.tis_bounds == (0.5, 1.5)
    config, _ = config_from_slime_args(parser.parse_args(["--use-tis", "--tis-mode", "mask", "--tis-level",
                                                          "geometric", "--tis-upper-bound", "1.1"]))
    assert config.tis_mode == "mask" and config.tis_level == "geometric" and config.tis_bounds == (1 / 1.1, 1.1)


def test_slime_flags_configure_slime_corr_on_slime_parser():
    parser = extended(slime_parser())
    args = parser.parse_args(["--use-tis", "--tis-clip", "1.5", "--tis-clip-low", "0.5", "--eps-clip", "0.1",
                              "--use-rs", "--rs-upper-bound", "3", "--rs-level", "sequence"])
    config = config_from_args(args)  # slime's reused flags count as given when they differ from slime's default
    assert config.use_tis and config.tis_bounds == (0.5, 1.5) and config.effective_tis_mode == "clip"
    assert config.eps_clip == 0.1 and config.use_rs and config.rs_level == "sequence"
    args = parser.parse_args(["--use-tis"])  # slime's --tis-clip default 2.0 is the default bound, not a setting
    config = config_from_args(args)
    assert config.tis_clip is None and config.tis_bounds[1] == 2.0
    # slime's --custom-tis-function-path holds slime's hook (slime's signature): not a slime_corr weighting function
    config = config_from_args(parser.parse_args(SLIME_SCRIPT[-5:]))
    assert config.custom_tis_function_path is None
    # slime's mis.yaml through --custom-config-path: slime's meaning (null RS bounds = IS bounds)
    with pytest.warns(UserWarning, match="tis_lower_bound 0.5 is ignored by tis_mode truncate"):
        config = config_from_args(parser.parse_args(SLIME_SCRIPT[-5:]))
    assert config.use_rs and config.rs_bounds == (0.5, 2.0) and config.rs_veto_threshold == 1e-4


def test_kl_coef_has_slime_meaning_or_is_refused():
    # on slime's parser: slime's flag, slime's reward-KL meaning (slime_corr's --kl-loss-coef untouched)
    args = extended(slime_parser()).parse_args(["--kl-coef", "0.05"])
    assert args.kl_coef == 0.05 and args.kl_loss_coef == 0.0
    # on slime_corr's own parser: refused at parse time unless 0
    from slime_corr.main import parse_run_config

    for argv, want in ((["--kl-coef", "0.05"], "slime's KL penalty on the reward"),
                       (["--kl-coef", "0.05", "--kl-loss-coef", "0.01"], "only one of them")):
        with pytest.raises(ConfigError, match=want):
            LossTermsConfig.from_args(extended(argparse.ArgumentParser()).parse_args(argv))
    with pytest.raises(SystemExit):
        parse_run_config(["--kl-coef", "0.05"], check_urls=False)
    assert LossTermsConfig.from_args(extended(argparse.ArgumentParser()).parse_args(["--kl-coef", "0"])).kl_loss_coef == 0


def test_loss_type_old_spelling_still_works_with_a_note(capsys):
    parser = extended(argparse.ArgumentParser())
    args = parser.parse_args(["--use-rollout-logprobs", "--loss-type", "reinforce"])
    assert config_from_args(args).loss_type == "reinforce"
    assert "--loss-type reinforce is deprecated: use --policy-loss-type reinforce" in capsys.readouterr().err
    args = parser.parse_args(["--use-rollout-logprobs", "--policy-loss-type", "reinforce"])
    assert config_from_args(args).loss_type == "reinforce"


def test_different_meaning_is_an_error_naming_both():
    host = argparse.ArgumentParser()
    host.add_argument("--tis-mode", choices=["icepop", "tis"], default="tis", help="the host's TIS variant")
    with pytest.raises(ConfigError, match=r"--tis-mode is defined twice with different meanings: the parser's "
                                          r"\(choices \['icepop', 'tis'\].*the host's TIS variant\) and slime_corr's"):
        add_rollout_correction_args(host)
    host = argparse.ArgumentParser()
    host.add_argument("--entropy-coef", type=float, default=0.0)
    extended(host)  # slime's name and meaning: reused
    host = argparse.ArgumentParser()
    host.add_argument("--rs-upper-bound", type=float, default=None)  # the same flag restated: reused
    add_rollout_correction_args(host)


def test_extension_on_megatron_parser():
    host = megatron_parser()
    before = set(host._option_string_actions)
    parser = extended(host)
    assert not (set(parser._option_string_actions) - before) & before
    args = parser.parse_args(["--use-tis", "--micro-batch-size", "2", "--calculate-per-token-loss",
                              "--loss-type", "ppo"] if "--loss-type" not in before else ["--use-tis"])
    assert config_from_args(args).use_tis
    args = parser.parse_args(["--use-tis", "--rl-inference-logprobs-is-correction"])
    with pytest.raises(ConfigError, match="corrects the loss twice"):
        config_from_args(args)
