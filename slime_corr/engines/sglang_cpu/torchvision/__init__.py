"""Stand-in for ``torchvision`` on CPU (see ``../sitecustomize.py``). sglang imports it at module level through a
vision-language config, and transformers' image utilities import ``torchvision.io`` / ``transforms.v2`` once it
is importable; text models call none of it. Every ``torchvision.*`` submodule imports, every attribute is a
placeholder, and calling one raises."""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0+slime-corr-cpu-stand-in"


class _PlaceholderMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):
        raise NotImplementedError(f"torchvision.{cls.__qualname__}: CPU stand-in (slime_corr/engines/sglang_cpu)")


def _placeholder(name):
    return _PlaceholderMeta(name, (), {"__qualname__": name})


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{self.__name__.removeprefix('torchvision.')}.{name}")


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_SubmoduleFinder())
sys.modules[__name__].__class__ = _Module
__path__ = []
