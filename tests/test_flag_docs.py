"""docs/flags.md is the main job's parser as it is (`python -m slime_corr.flag_docs --check`), and every flag is
defined once: a config field that is a flag is shown by one flag group, with the field's default and help."""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass
from typing import Literal

import pytest

from slime_corr import flag_docs
from slime_corr.config import RolloutCorrectionConfig
from slime_corr.fields import add_flags, flag, flag_fields, option_of
from slime_corr.flags import correction as correction_flags
from slime_corr.flags import loss_terms as loss_terms_flags
from slime_corr.flags import model as model_flags
from slime_corr.flags import monitoring as monitoring_flags
from slime_corr.flags import trainer as trainer_flags
from slime_corr.flags.main_job import MAIN_JOB_DEFAULTS
from slime_corr.loss_terms import LossTermsConfig
from slime_corr.main import build_parser
from slime_corr.mcore.model import TinyGPTArgs
from slime_corr.mcore.precision import PrecisionConfig
from slime_corr.models.selection import ModelSource
from slime_corr.monitoring.config import MonitoringConfig
from slime_corr.trainer.config import TrainerConfig


def test_the_flag_reference_is_current() -> None:
    assert flag_docs.main(["--check"]) == 0  # `python -m slime_corr.flag_docs --check`, in this process


def test_the_reference_lists_every_flag_once_with_its_help() -> None:
    parser = build_parser()
    text = flag_docs.render(parser)
    flags = [s for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)
             for s in a.option_strings]
    assert len(flags) == len(set(flags)) > 100  # argparse refuses a second definition; a host parser would too
    for option in flags:
        assert text.count(f"`{option}`") == 1, option
    assert "| `--use-tis` | off |" in text and "| `--rollout-engine` | `sglang` | sglang, embedded |" in text


def test_a_stale_reference_is_found(tmp_path, monkeypatch) -> None:
    stale = tmp_path / "flags.md"
    stale.write_text(flag_docs.render(build_parser()).replace("--use-tis", "--use-tiss", 1))
    monkeypatch.setattr(flag_docs, "DOC", stale)
    assert flag_docs.main(["--check"]) == 1
    assert flag_docs.main([]) == 0 and flag_docs.main(["--check"]) == 0


# Every config field that is a flag (`slime_corr.fields.flag`), by the flag group that shows it.
OWNERS = {RolloutCorrectionConfig: correction_flags.FIELDS, LossTermsConfig: loss_terms_flags.FIELDS,
          TrainerConfig: trainer_flags.FIELDS, TinyGPTArgs: model_flags.TINY_MODEL, ModelSource: model_flags.PRETRAINED,
          MonitoringConfig: monitoring_flags.FIELDS, PrecisionConfig: trainer_flags.PRECISION}
# The main job's flags that are not a config field's (defaults that depend on other flags, verl's spelling, ...).
HAND_WRITTEN = {"--self-check", "--lr", "--task", "--sglang-url", "--custom-function-traceback", "--kl-coef",
                "--rollout-rs", "--rollout-rs-threshold", "--loss-type"}


def test_every_flag_field_has_one_owner_and_its_default() -> None:
    parser = build_parser()
    actions = {option: a for a in parser._actions for option in a.option_strings}
    owners: Counter[str] = Counter()
    for cls, names in OWNERS.items():
        assert sorted(names) == sorted(flag_fields(cls)), cls.__name__  # each flag field shown, by one group, once
        for field in flag_fields(cls).values():
            option = option_of(field)
            owners[option] += 1
            action = actions[option]
            assert action.default == MAIN_JOB_DEFAULTS.get(action.dest, field.default), option
            assert action.help, option
    assert [option for option, n in owners.items() if n > 1] == []  # one definition per flag
    hand_written = {a.option_strings[0] for a in parser._actions if a.option_strings
                    and not isinstance(a, argparse._HelpAction) and not owners.keys() & set(a.option_strings)}
    assert hand_written == HAND_WRITTEN


def test_megatron_lm_s_flags_are_the_config_fields_flags() -> None:
    """Megatron-LM's `extra_args_provider` (`add_megatron_lm_args`) shows the same flags as the main job, from the
    same fields: the correction's and the two routing flags of `TrainerConfig`, each once, nothing of its own."""
    from slime_corr.flags.megatron_lm import ROUTING_FIELDS, add_megatron_lm_args

    parser = add_megatron_lm_args(argparse.ArgumentParser())
    main_job = {option: a for a in build_parser()._actions for option in a.option_strings}
    options = [o for a in parser._actions if not isinstance(a, argparse._HelpAction) for o in a.option_strings]
    assert len(options) == len(set(options))
    routing = {option_of(flag_fields(TrainerConfig)[name]) for name in ROUTING_FIELDS}
    assert routing <= set(options)
    for a in parser._actions:
        if a.option_strings and not isinstance(a, argparse._HelpAction):
            twin = main_job[a.option_strings[0]]  # the main job's flag of that name: same field, same shape
            assert (a.dest, a.default, a.help, a.choices, a.nargs, a.const) == \
                (twin.dest, twin.default, twin.help, twin.choices, twin.nargs, twin.const), a.option_strings


def test_a_flag_field_takes_its_shape_from_the_annotation() -> None:
    @dataclass(frozen=True)
    class Example:
        on: bool = flag(False, help="a switch")
        off: bool = flag(True, option="--no-off", help="turned off")
        both: bool = flag(True, help="--both / --no-both")
        mode: Literal["a", "b"] = flag("a", help="choices")
        bound: float | None = flag(None, metavar="U", help="a number")
        name: str | None = flag(None, option="--the-name", dest="the_name", help="a string")
        plain: int = 3

    parser = argparse.ArgumentParser()
    add_flags(parser, Example, flag_fields(Example))
    assert "plain" not in flag_fields(Example)
    args = parser.parse_args(["--on", "--no-off", "--no-both", "--mode", "b", "--bound", "2", "--the-name", "x"])
    assert (args.on, args.off, args.both, args.mode, args.bound, args.the_name) == (True, False, False, "b", 2.0, "x")
    assert vars(parser.parse_args([])) == {"on": False, "off": True, "both": True, "mode": "a", "bound": None,
                                           "the_name": None}
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "c"])
