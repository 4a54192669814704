"""Flags on a host parser (slime's, Megatron-LM's), and the record of which flags were given.

Only the flags the host lacks are added. A flag the host already defines is reused when its meaning is slime_corr's
(`SHARED_FLAGS`, slime's names, or the same choices / type), else adding the extension fails naming both
definitions. The actions `Store` and `StoreTrue` record the flags given on the command line, so that
`RolloutCorrectionConfig.from_args` can apply the precedence explicit flag > YAML > preset > default.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from slime_corr.errors import ConfigError

EXPLICIT_ATTR = "_rollout_correction_explicit"
HOST_FLAGS_ATTR = "_rollout_correction_host_flags"  # {dest: the host's default} of the reused host flags
# Flags slime defines with slime_corr's meaning (slime/utils/arguments.py); a host's definition is reused.
SHARED_FLAGS = frozenset({
    "--use-tis", "--tis-clip", "--tis-clip-low", "--custom-tis-function-path", "--custom-config-path",
    "--use-rollout-logprobs", "--get-mismatch-metrics", "--eps-clip", "--eps-clip-high", "--eps-clip-c",
    "--use-kl-loss", "--kl-loss-coef", "--kl-coef", "--kl-loss-type", "--entropy-coef",
})
FIELD_OF_DEST = {"policy_loss_type": "loss_type"}  # the attribute of --policy-loss-type -> its config field


def _record(namespace: argparse.Namespace, dest: str) -> None:
    explicit = getattr(namespace, EXPLICIT_ATTR, None)
    if explicit is None:
        explicit = set()
        setattr(namespace, EXPLICIT_ATTR, explicit)
    explicit.add(FIELD_OF_DEST.get(dest, dest))


class Store(argparse._StoreAction):
    """argparse's store, recording that the flag was given."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        super().__call__(parser, namespace, values, option_string)
        _record(namespace, self.dest)


class StoreTrue(argparse._StoreTrueAction):
    """argparse's store_true, recording that the switch was given."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        super().__call__(parser, namespace, values, option_string)
        _record(namespace, self.dest)


class DeprecatedLossType(Store):
    """`--loss-type ppo|reinforce`: stores `--policy-loss-type`, with a deprecation note."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        print(f"slime_corr: --loss-type {values} is deprecated: use --policy-loss-type {values} (slime's "
              "--loss-type chooses policy_loss / sft_loss / custom_loss).", file=sys.stderr)
        super().__call__(parser, namespace, values, option_string)


def recording(kw: dict[str, Any]) -> dict[str, Any]:
    """`add_argument` keywords with the recording action in place of argparse's store / store_true."""
    return {**kw, "action": StoreTrue if kw.get("action") == "store_true" else Store}


def _same_shape(host: argparse.Action, kw: dict[str, Any]) -> bool:
    """Whether the host's flag takes the same values as ours (then it is one flag defined twice)."""
    ours_switch = kw.get("action") in (StoreTrue, "store_true")
    host_switch = isinstance(host, argparse._StoreTrueAction)
    return ours_switch == host_switch and (ours_switch or (
        kw.get("type") == host.type and list(kw.get("choices") or []) == list(host.choices or [])))


def _describe(action: argparse.Action) -> str:
    what = "a switch" if isinstance(action, argparse._StoreTrueAction) else (
        f"choices {list(action.choices)}" if action.choices else f"type {getattr(action.type, '__name__', 'str')}")
    return f"{what}, default {action.default!r}: {action.help or 'no help'}"


def compose_flag(parser: argparse.ArgumentParser, group: Any, option: str, **kw: Any) -> bool:
    """Add `option` to `group`, or reuse the host parser's definition when it means the same (`SHARED_FLAGS`, or the
    same values); where meanings differ, raise `ConfigError` naming both. Returns whether it was added."""
    host = parser._option_string_actions.get(option)
    if host is None:
        group.add_argument(option, **kw)
        return True
    if option not in SHARED_FLAGS and not _same_shape(host, kw):
        raise ConfigError(
            f"{option} is defined twice with different meanings: the parser's ({_describe(host)}) and "
            f"slime_corr's ({kw.get('help')}). Rename one of them; slime_corr does not redefine a host flag.")
    hosted = dict(parser._defaults.get(HOST_FLAGS_ATTR, {}))
    hosted[host.dest] = host.default
    parser.set_defaults(**{HOST_FLAGS_ATTR: hosted})
    return False


__all__ = ["EXPLICIT_ATTR", "FIELD_OF_DEST", "HOST_FLAGS_ATTR", "SHARED_FLAGS", "DeprecatedLossType", "Store",
           "StoreTrue", "compose_flag", "recording"]
