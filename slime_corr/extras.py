"""How to install an optional part of slime_corr (an extra of its pyproject.toml): the one place the hints that
error messages give are written. slime_corr is installed from its checkout (it is not on PyPI), so a hint names
the editable install of the extra and, for a user of another environment (slime's, Megatron-LM's), the extra's own
packages as pyproject.toml declares them (read from the installed package's metadata)."""

from __future__ import annotations

import importlib.metadata
import re

EXTRAS = ("model", "plot", "tensorboard", "wandb", "sglang", "te")


def extra_packages(extra: str) -> list[str]:
    """The requirements of `extra` as the installed slime_corr declares them (pyproject.toml's
    [project.optional-dependencies]); [] when its metadata cannot be read."""
    if extra not in EXTRAS:
        raise ValueError(f"extra {extra!r}: not one of {', '.join(EXTRAS)}")
    try:
        requires = importlib.metadata.requires("slime_corr") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    marker = re.compile(rf"""\s*;\s*extra\s*==\s*["']{re.escape(extra)}["']\s*$""")
    return [marker.sub("", r).strip() for r in requires if marker.search(r)]


def install_hint(extra: str) -> str:
    """`pip install -e '.[EXTRA]'` in the checkout, or the extra's packages by name."""
    packages = " ".join(f"'{p}'" for p in extra_packages(extra))
    return f"pip install -e '.[{extra}]' in the slime_corr checkout" + (f" (or pip install {packages})"
                                                                           if packages else "")


__all__ = ["EXTRAS", "extra_packages", "install_hint"]
