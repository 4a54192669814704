"""Small registries for weighting and loss functions, and the loader for `--custom-tis-function-path`.

A function is found by registered name, or by path in one of three forms:
`package.module.function`, `package.module:function`, or `path/to/file.py:function`.
Loading happens at start-up (config time), so a bad path or signature fails before the first step.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slime_corr.errors import ConfigError


class Registry:
    """A name -> function table with a decorator, e.g. `@WEIGHT_FUNCTIONS.register("default")`."""

    def __init__(self, kind: str, required_params: tuple[str, ...], returns: str | None = None) -> None:
        self.kind = kind
        self.required_params = required_params
        self.returns = returns  # the class name a function must be annotated to return, when it is annotated
        self._table: dict[str, Callable[..., Any]] = {}

    def register(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
            if name in self._table and self._table[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            check_signature(fn, self.required_params, what=f"{self.kind} {name!r}", returns=self.returns)
            self._table[name] = fn
            return fn

        return decorator

    def names(self) -> list[str]:
        return sorted(self._table)

    def get(self, name_or_path: str, *, flag: str) -> Callable[..., Any]:
        """A registered name, or an import path (loaded and signature-checked)."""
        if name_or_path in self._table:
            return self._table[name_or_path]
        if ":" not in name_or_path and "." not in name_or_path and "/" not in name_or_path:
            raise ConfigError(
                f"{flag} {name_or_path!r}: no {self.kind} of that name (registered: "
                f"{', '.join(self.names()) or 'none'}); or give 'package.module:function' or 'file.py:function'."
            )
        fn = load_function(name_or_path, flag=flag)
        check_signature(fn, self.required_params, what=f"{flag} {name_or_path}", returns=self.returns)
        return fn


def load_function(path: str, *, flag: str = "--custom-tis-function-path") -> Callable[..., Any]:
    """Import a function from `pkg.mod.fn`, `pkg.mod:fn` or `path/to/file.py:fn`."""
    if not isinstance(path, str):
        raise ConfigError(f"{flag}: expected a string 'package.module:function' or 'file.py:function', got "
                          f"{type(path).__name__}.")
    if ":" not in path and (path.endswith(".py") or "/" in path or "\\" in path):
        file = path if path.endswith(".py") else f"{path}.py"
        raise ConfigError(f"{flag} {path!r}: a file path needs the function after a colon: '{file}:function_name'.")
    if ":" in path:
        module_part, _, attr = path.rpartition(":")
    else:
        module_part, _, attr = path.rpartition(".")
    if not module_part or not attr:
        raise ConfigError(
            f"{flag} {path!r}: expected 'package.module.function', 'package.module:function' "
            "or 'path/to/file.py:function'."
        )
    if module_part.endswith(".py") or "/" in module_part or "\\" in module_part:
        file = Path(module_part)
        if not file.is_file():
            raise ConfigError(f"{flag} {path!r}: file {module_part} does not exist.")
        module_name = f"_slime_corr_custom_{abs(hash(str(file.resolve())))}"
        spec = importlib.util.spec_from_file_location(module_name, file)
        if spec is None or spec.loader is None:
            raise ConfigError(f"{flag} {path!r}: cannot load {module_part} as a Python file.")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(module_name, None)
            raise ConfigError(f"{flag} {path!r}: importing {module_part} failed: {e!r}") from e
    else:
        try:
            module = importlib.import_module(module_part)
        except Exception as e:
            raise ConfigError(f"{flag} {path!r}: cannot import module {module_part!r}: {e!r}") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"{flag} {path!r}: module {module_part!r} has no attribute {attr!r}.")
    if not callable(fn):
        raise ConfigError(f"{flag} {path!r}: {attr!r} is not callable.")
    return fn


def check_signature(fn: Callable[..., Any], required_params: tuple[str, ...], *, what: str,
                    returns: str | None = None) -> None:
    """The function must accept the documented arguments positionally, in order; if its return type is annotated,
    the annotation must name `returns` (a Tensor-returning weighting function fails here, not at its first call;
    an unannotated one is checked at its first call)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{what}: cannot inspect its signature ({e}).") from e
    try:
        sig.bind(*required_params)
    except TypeError as e:
        raise ConfigError(
            f"{what}: signature {sig} does not match the documented ({', '.join(required_params)}): {e}."
        ) from e
    annotation = sig.return_annotation
    if returns is None or annotation is inspect.Signature.empty:
        return
    if isinstance(annotation, type):
        names, shown = [c.__name__ for c in annotation.__mro__], annotation.__name__
    elif isinstance(annotation, str) and re.fullmatch(r"[\w.]+", annotation):  # `from __future__ import annotations`
        names, shown = [annotation.rsplit(".", 1)[-1]], annotation
    else:  # a union, a generic, ...: checked at the first call
        return
    if returns not in names:
        raise ConfigError(f"{what}: it is annotated to return {shown}, but it must return {returns}.")


# Weighting functions: fn(inputs: WeightInputs, config) -> WeightOutputs (see slime_corr.correction).
# The built-in IS/RS of docs/theory.md is registered as "default"; --custom-tis-function-path replaces it.
WEIGHT_FUNCTIONS = Registry("weighting function", ("inputs", "config"), returns="WeightOutputs")
# Policy losses: fn(inputs: LossInputs, config) -> per-token loss tensor (see slime_corr.losses).
LOSS_FUNCTIONS = Registry("policy loss", ("inputs", "config"), returns="Tensor")
