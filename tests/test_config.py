"""The configuration object: presets, YAML files, precedence and every validation error."""

from pathlib import Path

import pytest
import yaml

from slime_corr import config as config_module
from slime_corr.config import PRESETS, ConfigError, RolloutCorrectionConfig

ROOT = Path(__file__).resolve().parents[1]
ARGUMENTS = ROOT / "arguments"


def test_defaults_are_plain_ppo_without_correction():
    c = RolloutCorrectionConfig()
    assert not c.use_rollout_correction and not c.computes_metrics
    assert c.loss_type == "ppo" and c.loss_agg_mode == "token-mean"
    assert c.tis_bounds == (0.5, 2.0)
    assert c.clip_range == (0.8, 1.2)


# Modes and levels of the preset table in reference 000.
EXPECTED_PRESETS = {
    "decoupled_token_is": dict(bypass=False, loss="ppo", tis="token", rs=None, veto=None),
    "decoupled_seq_is": dict(bypass=False, loss="ppo", tis="sequence", rs=None, veto=None),
    "decoupled_seq_is_rs": dict(bypass=False, loss="ppo", tis="sequence", rs="sequence", veto=None),
    "decoupled_geo_rs": dict(bypass=False, loss="ppo", tis=None, rs="geometric", veto=1e-4),
    "ppo_is_bypass": dict(bypass=True, loss="ppo", tis=None, rs=None, veto=None),
    "pg_is": dict(bypass=True, loss="reinforce", tis="sequence", rs=None, veto=None),
    "pg_rs": dict(bypass=True, loss="reinforce", tis=None, rs="geometric", veto=1e-4),
    "disabled": dict(bypass=False, loss="ppo", tis=None, rs=None, veto=None),
    # divergence rejection (verl's k3 presets and its seq_max_k2 filter): `div` = (metric, agg, bound)
    "decoupled_k3_rs": dict(bypass=False, loss="ppo", tis=None, rs=None, veto=None, div=("k3", "mean", 0.005)),
    "decoupled_token_is_k3_rs": dict(bypass=False, loss="ppo", tis="token", rs=None, veto=None,
                                     div=("k3", "mean", 0.005)),
    "decoupled_token_is_max_k2_rs": dict(bypass=False, loss="ppo", tis="token", rs=None, veto=None,
                                         div=("k2", "max", 2.5)),
    "ppo_k3_rs_bypass": dict(bypass=True, loss="ppo", tis=None, rs=None, veto=None, div=("k3", "mean", 0.005)),
}


def test_preset_table_matches_the_reference():
    assert set(PRESETS) == set(EXPECTED_PRESETS)
    for name, want in EXPECTED_PRESETS.items():
        c = RolloutCorrectionConfig.preset(name)
        assert c.rollout_correction_preset == name
        assert c.use_rollout_logprobs is want["bypass"], name
        assert c.loss_type == want["loss"], name
        assert (c.tis_level if c.use_tis else None) == want["tis"], name
        assert (c.rs_level if c.use_rs else None) == want["rs"], name
        assert c.rs_veto_threshold == want["veto"], name
        div = (c.rs_metric, c.rs_agg, c.rs_divergence_bound) if c.rejects_divergence else None
        assert div == want.get("div"), name
        assert c.computes_metrics, name
    assert not RolloutCorrectionConfig.preset("disabled").use_rollout_correction
    assert RolloutCorrectionConfig.preset("decoupled_seq_is_rs").rs_bounds == (0.5, 2.0)
    lo, hi = RolloutCorrectionConfig.preset("decoupled_geo_rs").rs_bounds
    assert hi == 1.001 and lo == pytest.approx(1 / 1.001)


def test_preset_constructors_and_overrides():
    c = config_module.decoupled_token_is(tis_upper_bound=5.0)
    assert c.use_tis and c.tis_bounds[1] == 5.0
    assert config_module.pg_rs().loss_type == "reinforce"
    with pytest.raises(ConfigError, match="--rollout-correction-preset 'nope' is unknown; choose one of"):
        RolloutCorrectionConfig.preset("nope")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_yaml_file_loads_to_its_preset(name):
    from_file = RolloutCorrectionConfig.from_yaml(ARGUMENTS / f"{name}.yaml")
    from_preset = RolloutCorrectionConfig.preset(name)
    assert from_file.replace(rollout_correction_preset=name, custom_config_path=None) == from_preset


@pytest.mark.parametrize("path", sorted(ARGUMENTS.glob("example_*.yaml")), ids=lambda p: p.name)
def test_example_yaml_files_load(path):
    c = RolloutCorrectionConfig.from_yaml(path)
    assert c.use_rollout_correction


def test_yaml_preset_key_is_applied_first(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("preset: decoupled_seq_is\ntis_upper_bound: 4.0\n")
    c = RolloutCorrectionConfig.from_yaml(f)
    assert c.tis_level == "sequence" and c.tis_bounds[1] == 4.0
    assert c.rollout_correction_preset == "decoupled_seq_is"


def test_yaml_accepts_dashed_keys(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("use-tis: true\ntis-level: geometric\n")
    assert RolloutCorrectionConfig.from_yaml(f).tis_level == "geometric"


@pytest.mark.parametrize(
    "text, message",
    [
        ("use_tis: true\ntis_colour: red\n", "unknown key(s) tis_colour; valid keys are"),
        ("- a\n- b\n", "expected a mapping of option names to values, got list"),
        ("use_tis: [unclosed\n", "not valid YAML"),
        ("preset: nope\n", "preset 'nope' is unknown"),
        # values are type-checked: a string never turns a switch on, a non-number is not a number
        ('use_tis: "no"\n', "use_tis must be true or false (unquoted), got 'no' (str)"),
        ("use_tis: 1\n", "use_tis must be true or false (unquoted), got 1 (int)"),
        ("use_tis: true\ntis_upper_bound: three\n", "tis_upper_bound must be a number, got 'three' (str)"),
        ("use_tis: true\ntis_upper_bound: [3]\n", "tis_upper_bound must be a number, got [3] (list)"),
        ("use_tis: true\ntis_mode: 3\n", "tis_mode must be a string, got 3 (int)"),
    ],
)
def test_bad_yaml_files(tmp_path, text, message):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=f"--custom-config-path {f}") as e:
        RolloutCorrectionConfig.from_yaml(f)
    assert message in str(e.value)


def test_missing_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file; pass an existing YAML file"):
        RolloutCorrectionConfig.from_yaml(tmp_path / "missing.yaml")


def test_empty_yaml_file_gives_defaults(tmp_path):
    f = tmp_path / "empty.yaml"
    f.write_text("")
    assert RolloutCorrectionConfig.from_yaml(f).replace(custom_config_path=None) == RolloutCorrectionConfig()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(use_tis=True, use_rollout_logprobs=True), "--use-tis with --use-rollout-logprobs and --policy-loss-type ppo corrects twice"),
        (dict(loss_type="reinforce"), "--policy-loss-type reinforce is pure policy gradient on rollout data and needs --use-rollout-logprobs"),
        (dict(use_rs=True), "--use-rs needs --rs-upper-bound"),
        (dict(use_rs=True, rs_upper_bound=2.0, rs_lower_bound=3.0), "--rs-lower-bound 3.0 > --rs-upper-bound 2.0; give --rs-lower-bound <= --rs-upper-bound"),
        (dict(use_tis=True, tis_mode="clip", tis_lower_bound=3.0, tis_upper_bound=2.0), "--tis-lower-bound 3.0 > --tis-upper-bound 2.0"),
        (dict(use_tis=True, tis_mode="clip", tis_lower_bound=3.0), "--tis-lower-bound 3.0 > the default upper bound 2.0 (--tis-upper-bound)"),
        # a bound below 1 without a lower bound: the message names the bound given and the default it implies
        (dict(use_tis=True, tis_mode="clip", tis_upper_bound=0.5), "--tis-upper-bound 0.5 is below 1, so the default lower bound 1/U = 2 is above it; give --tis-lower-bound (<= 0.5)"),
        (dict(use_rs=True, rs_upper_bound=0.5), "--rs-upper-bound 0.5 is below 1, so the default lower bound 1/U = 2 is above it; give --rs-lower-bound"),
        # a bound without the flag that uses it (as for RS)
        (dict(tis_upper_bound=3.0), "--tis-upper-bound set but --use-tis is not; add --use-tis or drop it"),
        (dict(tis_clip=3.0, tis_clip_low=0.1), "--tis-clip, --tis-clip-low set but --use-tis is not; add --use-tis or drop them"),
        (dict(rs_lower_bound=0.5), "--rs-upper-bound/--rs-lower-bound are set but --use-rs is not"),
        # types: no string or number turns a flag on; a string is not a number
        (dict(use_tis="no"), "--use-tis (use_tis) must be true or false, got 'no' (str)"),
        (dict(use_rs=1), "--use-rs (use_rs) must be true or false, got 1 (int)"),
        (dict(use_tis=True, tis_upper_bound="3.0"), "--tis-upper-bound (tis_upper_bound) must be a number, got '3.0' (str); write the number without quotes"),
        (dict(use_tis=True, tis_upper_bound=True), "--tis-upper-bound (tis_upper_bound) must be a number, got True (bool)"),
        (dict(eps_clip=None), "--eps-clip (eps_clip) must be a number, got None"),
        (dict(tis_mode=3), "--tis-mode (tis_mode) must be a string, got 3 (int)"),
        (dict(use_tis=True, custom_tis_function_path=["f.py:fn"]), "--custom-tis-function-path (custom_tis_function_path) must be a string"),
        (dict(use_tis=True, tis_upper_bound=0.0), "--tis-upper-bound=0.0 must be a finite number > 0"),
        (dict(use_tis=True, tis_upper_bound=-1.0), "--tis-upper-bound=-1.0 must be a finite number > 0"),
        (dict(use_tis=True, tis_upper_bound=float("inf")), "--tis-upper-bound=inf must be a finite number > 0"),
        (dict(use_tis=True, tis_mode="clip", tis_lower_bound=0.0), "--tis-lower-bound=0.0 must be a finite number > 0"),
        (dict(use_rs=True, rs_upper_bound=-2.0), "--rs-upper-bound=-2.0 must be a finite number > 0"),
        (dict(use_rs=True, rs_upper_bound=2.0, rs_lower_bound=0.0), "--rs-lower-bound=0.0 must be a finite number > 0"),
        (dict(rs_veto_threshold=1.0), "--rs-veto-threshold=1.0 must be in (0, 1)"),
        (dict(rs_veto_threshold=0.0), "--rs-veto-threshold=0.0 must be in (0, 1)"),
        (dict(rs_veto_threshold=2.5), "--rs-veto-threshold=2.5 must be in (0, 1)"),
        (dict(rs_upper_bound=2.0), "--rs-upper-bound/--rs-lower-bound are set but --use-rs is not"),
        (dict(use_rollout_correction=True), "--use-rollout-correction enables nothing by itself"),
        (dict(tis_batch_normalize=True), "--tis-batch-normalize needs --use-tis"),
        (dict(use_tis=True, tis_lower_bound=0.5), "--tis-lower-bound has no effect with --tis-mode truncate"),
        (dict(use_tis=True, tis_clip=2.0, tis_upper_bound=3.0), "--tis-clip/--tis-clip-low (slime's flags) and --tis-upper-bound/--tis-lower-bound set the same bounds"),
        (dict(use_tis=True, tis_clip=2.0, tis_mode="mask"), "--tis-clip/--tis-clip-low always clamp"),
        (dict(use_tis=True, tis_clip=2.0, tis_clip_low=3.0), "--tis-clip-low 3.0 > --tis-clip 2.0; swap them"),
        (dict(use_tis=True, tis_clip_low=-0.1), "--tis-clip-low=-0.1 must be a finite number >= 0"),
        (dict(tis_mode="nope"), "--tis-mode='nope' is not one of truncate, clip, mask"),
        (dict(tis_level="word"), "--tis-level='word' is not one of token, sequence, geometric"),
        (dict(rs_level="word"), "--rs-level='word' is not one of token, sequence, geometric"),
        (dict(loss_type="dpo"), "--policy-loss-type='dpo' is not one of ppo, reinforce"),
        (dict(loss_agg_mode="mean"), "--loss-agg-mode='mean' is not one of token-mean"),
        (dict(eps_clip=0.0), "--eps-clip=0.0 must be in (0, 1)"),
        (dict(eps_clip_high=-0.1), "--eps-clip-high=-0.1 must be a finite number > 0"),
        (dict(eps_clip_c=1.0), "--eps-clip-c=1.0 must be > 1"),
        (dict(use_rollout_logprobs=True, loss_type="reinforce", eps_clip_c=3.0), "--eps-clip-c (dual clip) applies to the PPO loss only"),
        (dict(rs_keep_loss_denominator=True), "--rs-keep-loss-denominator needs --use-rs or --rs-veto-threshold"),
        (dict(rollout_correction_preset="nope"), "--rollout-correction-preset 'nope' is unknown"),
        (dict(custom_tis_function_path="examples/custom_tis.py:length_aware_geometric_is"),
         "--custom-tis-function-path is only called when correction is on"),
    ],
)
def test_validation_errors_name_the_flag_and_the_fix(kwargs, message):
    with pytest.raises(ConfigError) as e:
        RolloutCorrectionConfig(**kwargs)
    assert message in str(e.value)


def test_valid_combinations_construct():
    # TIS under bypass is fine for REINFORCE (pg_is), RS is fine under bypass PPO, veto works without --use-rs.
    RolloutCorrectionConfig(use_rollout_logprobs=True, loss_type="reinforce", use_tis=True)
    RolloutCorrectionConfig(use_rollout_logprobs=True, use_rs=True, rs_upper_bound=2.0)
    c = RolloutCorrectionConfig(rs_veto_threshold=1e-4)
    assert c.use_rollout_correction and not c.use_rs
    # truncation uses no lower bound, so U < 1 is allowed there; an explicit L <= U < 1 is allowed everywhere
    assert RolloutCorrectionConfig(use_tis=True, tis_upper_bound=0.5).tis_bounds[1] == 0.5
    RolloutCorrectionConfig(use_rs=True, rs_lower_bound=0.2, rs_upper_bound=0.5)


def test_numbers_are_stored_as_float_and_numpy_scalars_are_accepted():
    import numpy as np

    c = RolloutCorrectionConfig(use_tis=np.bool_(True), tis_upper_bound=3, eps_clip=np.float32(0.25))
    assert c.use_tis is True and type(c.tis_upper_bound) is float and c.tis_upper_bound == 3.0
    assert type(c.eps_clip) is float and c.eps_clip == pytest.approx(0.25)


def test_turning_off_a_presets_switch_drops_its_bounds():
    c = RolloutCorrectionConfig.preset("decoupled_seq_is_rs", use_tis=False)
    assert not c.use_tis and c.tis_upper_bound is None and c.use_rs
    with pytest.raises(ConfigError, match="--tis-upper-bound set but --use-tis is not"):
        RolloutCorrectionConfig.preset("decoupled_seq_is_rs", use_tis=False, tis_upper_bound=3.0)


def test_yaml_numbers_written_as_strings_are_numbers(tmp_path):
    # YAML 1.1 (PyYAML) reads 1e-4 as a string; a quoted "3.0" is read as the number it spells
    f = tmp_path / "c.yaml"
    f.write_text('use_tis: true\ntis_upper_bound: "3.0"\nrs_veto_threshold: 1e-4\nuse_rs: yes\nrs_upper_bound: 2\n')
    c = RolloutCorrectionConfig.from_yaml(f)
    assert c.tis_upper_bound == 3.0 and c.rs_veto_threshold == 1e-4 and c.use_rs and c.rs_upper_bound == 2.0


@pytest.mark.parametrize("call, message", [
    (lambda: RolloutCorrectionConfig.from_dict([("use_tis", True)]), "config: expected a mapping of field names"),
    (lambda: RolloutCorrectionConfig.from_args({"use_tis": True}), "from_args expects an argparse.Namespace, got dict"),
    (lambda: RolloutCorrectionConfig.preset(["pg_is"]), "preset name must be a string"),
    (lambda: RolloutCorrectionConfig.from_yaml(3), "from_yaml: path must be a str or pathlib.Path, got int"),
])
def test_constructors_refuse_wrong_argument_types(call, message):
    with pytest.raises(ConfigError) as e:
        call()
    assert message in str(e.value)


def test_slime_tis_clip_flags_keep_their_meaning():
    c = RolloutCorrectionConfig(use_tis=True, tis_clip=3.0, tis_clip_low=0.1)
    assert c.effective_tis_mode == "clip" and c.tis_bounds == (0.1, 3.0)
    c = RolloutCorrectionConfig(use_tis=True, tis_clip=3.0)
    assert c.tis_bounds == (0.0, 3.0)  # slime's default lower clamp is 0: a plain truncation


def test_unknown_dict_key():
    with pytest.raises(ConfigError, match="unknown key\\(s\\) bogus"):
        RolloutCorrectionConfig.from_dict({"bogus": 1})


def test_yaml_round_trip(tmp_path):
    c = RolloutCorrectionConfig.preset("decoupled_seq_is_rs", eps_clip_c=3.0)
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(c.to_dict()))
    assert RolloutCorrectionConfig.from_yaml(f).replace(custom_config_path=None) == c
