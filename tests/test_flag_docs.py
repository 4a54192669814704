"""docs/flags.md is the main job's parser as it is (`python -m slime_corr.flag_docs --check`), and every flag is
defined once."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from slime_corr import flag_docs
from slime_corr.main import build_parser

ROOT = Path(__file__).resolve().parents[1]


def test_the_flag_reference_is_current() -> None:
    out = subprocess.run([sys.executable, "-m", "slime_corr.flag_docs", "--check"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr


def test_the_reference_lists_every_flag_once_with_its_help() -> None:
    parser = build_parser()
    text = flag_docs.render(parser)
    flags = [s for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)
             for s in a.option_strings]
    assert len(flags) == len(set(flags)) > 100  # argparse refuses a second definition; a host parser would too
    for flag in flags:
        assert text.count(f"`{flag}`") == 1, flag
    assert "| `--use-tis` | off |" in text and "| `--rollout-engine` | `sglang` | sglang, embedded |" in text


def test_a_stale_reference_is_found(tmp_path, monkeypatch) -> None:
    stale = tmp_path / "flags.md"
    stale.write_text(flag_docs.render(build_parser()).replace("--use-tis", "--use-tiss", 1))
    monkeypatch.setattr(flag_docs, "DOC", stale)
    assert flag_docs.main(["--check"]) == 1
    assert flag_docs.main([]) == 0 and flag_docs.main(["--check"]) == 0
