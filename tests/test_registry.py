"""Loading functions by name or path (`--custom-tis-function-path`) and checking their signature at start-up."""

import sys
import textwrap

import pytest

from slime_corr.config import ConfigError
from slime_corr.registry import Registry, load_function

FLAG = "--custom-tis-function-path"


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    pkg = tmp_path / "my_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "weights.py").write_text(textwrap.dedent("""
        def good(inputs, config):
            return ("good", inputs, config)

        def good_with_kwargs(inputs, config, *, extra=1):
            return "kw"

        def too_few(inputs):
            return None

        def too_many(inputs, config, cp_group):
            return None

        def returns_tensor(inputs, config) -> "torch.Tensor":
            return inputs.log_ratio

        def returns_weights(inputs, config) -> "slime_corr.correction.WeightOutputs":
            return None

        not_a_function = 3
    """))
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("my_pkg")]:
        del sys.modules[name]


def test_three_path_forms_load_the_same_function(module_dir):
    registry = Registry("weighting function", ("inputs", "config"))
    dotted = registry.get("my_pkg.weights.good", flag=FLAG)
    colon = registry.get("my_pkg.weights:good", flag=FLAG)
    from_file = registry.get(f"{module_dir}/my_pkg/weights.py:good", flag=FLAG)
    assert dotted is colon
    assert dotted(1, 2) == from_file(1, 2) == ("good", 1, 2)
    assert registry.get("my_pkg.weights.good_with_kwargs", flag=FLAG)(1, 2) == "kw"


@pytest.mark.parametrize(
    "path, message",
    [
        ("my_pkg.weights.too_few", "does not match the documented (inputs, config)"),
        ("my_pkg.weights.too_many", "does not match the documented (inputs, config)"),
        ("my_pkg.weights.missing", "module 'my_pkg.weights' has no attribute 'missing'"),
        ("my_pkg.weights:not_a_function", "'not_a_function' is not callable"),
        ("my_pkg.nope.fn", "cannot import module 'my_pkg.nope'"),
        ("{dir}/nope.py:fn", "does not exist"),
        ("{dir}/broken.py:fn", "importing {dir}/broken.py failed: RuntimeError('boom at import')"),
        ("justaname", "no weighting function of that name"),
        (":fn", "expected 'package.module.function'"),
        # a file without ':function' is not read as module 'weights' + attribute 'py'
        ("{dir}/my_pkg/weights.py", "a file path needs the function after a colon: '{dir}/my_pkg/weights.py:function_name'"),
        ("{dir}/my_pkg/weights", "a file path needs the function after a colon: '{dir}/my_pkg/weights.py:function_name'"),
        # a function annotated to return something else fails at start-up, not at its first call
        ("my_pkg.weights.returns_tensor", "it is annotated to return torch.Tensor, but it must return WeightOutputs"),
    ],
)
def test_bad_paths_fail_with_the_flag_and_reason(module_dir, path, message):
    registry = Registry("weighting function", ("inputs", "config"), returns="WeightOutputs")
    path = path.format(dir=module_dir)
    with pytest.raises(ConfigError) as e:
        registry.get(path, flag=FLAG)
    assert str(e.value).startswith(f"{FLAG} ")
    assert message.format(dir=module_dir) in str(e.value)


def test_registered_names_and_duplicates():
    registry = Registry("policy loss", ("inputs", "config"))

    @registry.register("mine")
    def mine(inputs, config):
        return inputs

    assert registry.get("mine", flag="--x") is mine
    assert registry.names() == ["mine"]
    registry.register("mine")(mine)  # the same function again is fine
    with pytest.raises(ValueError, match="already registered"):
        registry.register("mine")(lambda inputs, config: None)
    with pytest.raises(ConfigError, match="does not match the documented"):
        registry.register("bad")(lambda x: x)


def test_annotated_return_type_is_accepted(module_dir):
    registry = Registry("weighting function", ("inputs", "config"), returns="WeightOutputs")
    assert registry.get("my_pkg.weights.returns_weights", flag=FLAG) is not None
    from slime_corr.registry import WEIGHT_FUNCTIONS

    with pytest.raises(ConfigError, match="it is annotated to return Tensor, but it must return WeightOutputs"):
        import torch

        def bad(inputs, config) -> torch.Tensor:
            return inputs

        WEIGHT_FUNCTIONS.register("bad_return")(bad)


def test_load_function_plain():
    import os.path

    assert load_function("os.path.join") is os.path.join
