"""Flags: every flag parses into its config field, precedence flag > YAML > preset > default, errors exit."""

import argparse

import pytest

from slime_corr.arguments import (
    add_rollout_correction_args,
    config_from_args,
    parse_rollout_correction_config,
)
from slime_corr.config import RolloutCorrectionConfig
from slime_corr.main import main


def parse(argv):
    parser = add_rollout_correction_args(argparse.ArgumentParser(allow_abbrev=False))
    return parse_rollout_correction_config(parser, argv)


def test_no_flags_gives_default_config():
    _, c = parse([])
    assert c == RolloutCorrectionConfig()


# (flag words, field, expected value); a required partner flag is added where validation needs one.
FLAG_CASES = [
    (["--use-tis"], "use_tis", True),
    (["--use-tis", "--tis-mode", "clip"], "tis_mode", "clip"),
    (["--use-tis", "--tis-mode", "mask", "--tis-lower-bound", "0.3"], "tis_lower_bound", 0.3),
    (["--use-tis", "--tis-upper-bound", "5"], "tis_upper_bound", 5.0),
    (["--use-tis", "--tis-level", "geometric"], "tis_level", "geometric"),
    (["--use-tis", "--tis-batch-normalize"], "tis_batch_normalize", True),
    (["--use-tis", "--tis-clip", "4"], "tis_clip", 4.0),
    (["--use-tis", "--tis-clip", "4", "--tis-clip-low", "0.2"], "tis_clip_low", 0.2),
    (["--use-rs", "--rs-upper-bound", "2"], "use_rs", True),
    (["--use-rs", "--rs-upper-bound", "2", "--rs-lower-bound", "0.4"], "rs_lower_bound", 0.4),
    (["--use-rs", "--rs-upper-bound", "2", "--rs-level", "sequence"], "rs_level", "sequence"),
    (["--rs-veto-threshold", "1e-4"], "rs_veto_threshold", 1e-4),
    (["--rs-veto-threshold", "1e-4", "--rs-keep-loss-denominator"], "rs_keep_loss_denominator", True),
    (["--use-rollout-logprobs"], "use_rollout_logprobs", True),
    (["--use-tis", "--use-rollout-correction"], "use_rollout_correction", True),
    (["--get-mismatch-metrics"], "get_mismatch_metrics", True),
    (["--use-rollout-logprobs", "--policy-loss-type", "reinforce"], "loss_type", "reinforce"),
    (["--use-rollout-logprobs", "--loss-type", "reinforce"], "loss_type", "reinforce"),  # deprecated spelling
    (["--eps-clip", "0.1"], "eps_clip", 0.1),
    (["--eps-clip-high", "0.28"], "eps_clip_high", 0.28),
    (["--eps-clip-c", "3"], "eps_clip_c", 3.0),
    (["--loss-agg-mode", "seq-mean-token-sum-norm"], "loss_agg_mode", "seq-mean-token-sum-norm"),
    (["--rollout-correction-preset", "pg_is"], "rollout_correction_preset", "pg_is"),
]


@pytest.mark.parametrize("argv, field, value", FLAG_CASES, ids=[c[1] for c in FLAG_CASES])
def test_each_flag_sets_its_field(argv, field, value):
    args, c = parse(argv)
    assert getattr(args, {"loss_type": "policy_loss_type"}.get(field, field)) == value  # slime owns `loss_type`
    assert getattr(c, field) == value


def test_every_config_field_has_a_flag():
    parser = add_rollout_correction_args(argparse.ArgumentParser())
    dests = {a.dest for a in parser._actions}
    assert set(RolloutCorrectionConfig.field_names()) - {"loss_type"} <= dests and "policy_loss_type" in dests
    for action in parser._actions:
        if action.dest in RolloutCorrectionConfig.field_names():
            assert action.help and len(action.help) > 20, action.dest


def test_precedence_flag_over_yaml_over_preset_over_default(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("tis_upper_bound: 4.0\ntis_level: geometric\neps_clip: 0.3\n")
    _, c = parse(["--rollout-correction-preset", "decoupled_seq_is", "--custom-config-path", str(f),
                  "--tis-upper-bound", "8"])
    assert c.tis_bounds[1] == 8.0  # flag beats YAML
    assert c.tis_level == "geometric"  # YAML beats preset (sequence)
    assert c.use_tis  # from the preset
    assert c.tis_mode == "truncate" and c.loss_agg_mode == "token-mean"  # defaults
    assert c.eps_clip == 0.3
    assert c.custom_config_path == str(f)


def test_explicit_flag_equal_to_default_still_beats_yaml(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("eps_clip: 0.3\n")
    _, c = parse(["--custom-config-path", str(f), "--eps-clip", "0.2"])
    assert c.eps_clip == 0.2


def test_yaml_naming_a_preset(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("preset: pg_rs\nrs_veto_threshold: 1.0e-6\n")
    _, c = parse(["--custom-config-path", str(f)])
    assert c.loss_type == "reinforce" and c.rs_veto_threshold == 1e-6


def test_yaml_naming_an_unknown_preset_fails_with_the_file(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_text("preset: nope\n")
    with pytest.raises(SystemExit):
        parse(["--custom-config-path", str(f)])
    assert f"--custom-config-path {f}: preset 'nope' is unknown; choose one of" in capsys.readouterr().err


def test_preset_flag_beats_the_yaml_preset_key(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("preset: pg_rs\neps_clip: 0.3\n")
    _, c = parse(["--rollout-correction-preset", "decoupled_token_is", "--custom-config-path", str(f)])
    assert c.rollout_correction_preset == "decoupled_token_is" and c.use_tis and not c.use_rs
    assert c.eps_clip == 0.3


def test_from_args_on_a_plain_namespace_treats_non_defaults_as_explicit():
    ns = argparse.Namespace(use_tis=True, tis_level="sequence", tis_upper_bound=None)
    c = RolloutCorrectionConfig.from_args(ns)
    assert c.use_tis and c.tis_level == "sequence"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--use-rollout-logprobs", "--use-tis"], "corrects twice"),
        (["--loss-type", "reinforce"], "needs --use-rollout-logprobs"),
        (["--use-rs"], "--use-rs needs --rs-upper-bound"),
        (["--rs-veto-threshold", "5"], "--rs-veto-threshold=5.0 must be in (0, 1)"),
        (["--custom-config-path", "/nonexistent/x.yaml"], "no such file"),
        (["--use-tis", "--custom-tis-function-path", "no_such_module_xyz.fn"],
         "cannot import module 'no_such_module_xyz'"),
        (["--custom-tis-function-path", "examples/custom_tis.py:length_aware_geometric_is"],
         "--custom-tis-function-path is only called when correction is on; add --use-tis"),
        # a TIS bound without --use-tis is a parse-time error, as RS bounds without --use-rs are
        (["--tis-upper-bound", "3"], "--tis-upper-bound set but --use-tis is not; add --use-tis or drop it"),
        (["--rs-upper-bound", "3"], "--rs-upper-bound/--rs-lower-bound are set but --use-rs is not"),
        # the message names the bound given and the default it implies, not a bound the user never gave
        (["--use-tis", "--tis-mode", "clip", "--tis-upper-bound", "0.5"],
         "--tis-upper-bound 0.5 is below 1, so the default lower bound 1/U = 2 is above it"),
        (["--use-tis", "--custom-tis-function-path", "examples/custom_tis.py"],
         "a file path needs the function after a colon: 'examples/custom_tis.py:function_name'"),
        (["--use-tis", "--custom-tis-function-path", "examples/custom_tis"],
         "a file path needs the function after a colon: 'examples/custom_tis.py:function_name'"),
    ],
)
def test_bad_flags_exit_at_parse_time_with_the_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--tis-mode", "nope"], ["--rollout-correction-preset", "nope"],
                                  ["--tis-upper-bound", "abc"]])
def test_argparse_rejects_bad_choices_and_numbers(argv, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert "argument" in capsys.readouterr().err


# Flags of a Megatron-LM launch (megatron/training/arguments.py), including its own RL flags: ours must coexist
# with all of them. Megatron-LM's real parser (megatron-core 0.19.x ships it) runs in tests/mcore/test_megatron_lm.py.
MEGATRON_LAUNCH_FLAGS = [
    ("--tensor-model-parallel-size", int), ("--pipeline-model-parallel-size", int),
    ("--context-parallel-size", int), ("--sequence-parallel", None), ("--num-layers", int),
    ("--hidden-size", int), ("--ffn-hidden-size", int), ("--num-attention-heads", int),
    ("--seq-length", int), ("--max-position-embeddings", int), ("--micro-batch-size", int),
    ("--global-batch-size", int), ("--lr", float), ("--min-lr", float), ("--clip-grad", float),
    ("--weight-decay", float), ("--adam-beta1", float), ("--adam-beta2", float), ("--bf16", None),
    ("--fp16", None), ("--seed", int), ("--train-iters", int), ("--save", str), ("--load", str),
    ("--tokenizer-type", str), ("--calculate-per-token-loss", None), ("--attention-dropout", float),
    ("--hidden-dropout", float), ("--use-distributed-optimizer", None), ("--log-interval", int),
    ("--tensorboard-dir", str), ("--wandb-project", str), ("--transformer-impl", str),
    ("--perform-rl-step", None), ("--grpo-prompts-per-step", int), ("--grpo-group-size", int),
    ("--grpo-iterations", int), ("--grpo-clamp-eps-lower", float), ("--grpo-clamp-eps-upper", float),
    ("--grpo-kl-beta", float), ("--grpo-default-temperature", float), ("--grpo-default-top-p", float),
    ("--rl-inference-logprobs-is-correction", None), ("--rl-importance-sampling-truncation-coef", float),
    ("--rl-partial-rollouts", None), ("--rl-use-sequence-packing", None),
]


def megatron_like_parser():
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    for name, typ in MEGATRON_LAUNCH_FLAGS:
        if typ is None:
            parser.add_argument(name, action="store_true")
        else:
            parser.add_argument(name, type=typ)
    return parser


def test_flags_coexist_with_megatron_launch_flags():
    parser = add_rollout_correction_args(megatron_like_parser())  # argparse raises on any clash
    args, c = parse_rollout_correction_config(parser, [
        "--tensor-model-parallel-size", "2", "--context-parallel-size", "2", "--calculate-per-token-loss",
        "--grpo-group-size", "8", "--use-tis", "--tis-level", "sequence", "--use-rs", "--rs-upper-bound", "2",
    ])
    assert args.tensor_model_parallel_size == 2 and args.grpo_group_size == 8
    assert c.use_tis and c.tis_level == "sequence" and c.use_rs


def test_truncation_takes_an_upper_bound_below_one():
    _, c = parse(["--use-tis", "--tis-upper-bound", "0.5"])  # truncate uses no lower bound
    assert c.tis_bounds[1] == 0.5


def test_compile_flag():
    _, c = parse(["--use-tis", "--rollout-correction-compile"])
    assert c.rollout_correction_compile and not parse([])[1].rollout_correction_compile


def test_config_from_args_without_parser_records():
    ns = argparse.Namespace(**RolloutCorrectionConfig().to_dict())
    ns.use_rollout_logprobs = True
    assert config_from_args(ns).bypass


def test_main_self_check_prints_the_config(capsys):
    assert main(["--self-check", "--rollout-correction-preset", "decoupled_seq_is_rs"]) == 0
    out = capsys.readouterr().out
    assert "rs_level = 'sequence'" in out and "rollout_correction_preset = 'decoupled_seq_is_rs'" in out
