"""Stand-in for torchvision in qwen35-reshard's SGLang and vLLM test environments.

SGLang and vLLM import torchvision from modules unrelated to the code under test (transformers'
image processors, other models' configs), and the package index only offers a CUDA build of it,
which cannot load beside the CPU torch. Every ``torchvision.*`` module imports; every name in it
is a placeholder that raises when called. The tests run text-only, so none is ever called.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0"


class _Placeholder(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__name__}.{name}")

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"{cls.__name__}: torchvision is a stand-in in this environment")


def _placeholder(name: str) -> type:
    return _Placeholder(name, (), {})


class _Module(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: object, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _Module(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []


sys.meta_path.append(_Finder())
sys.modules[__name__].__class__ = _Module
