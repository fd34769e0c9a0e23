"""Kernel names SGLang imports from vllm; each raises if it is ever called."""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def kernel(*args, **kwargs):
        raise RuntimeError(f"vllm._custom_ops.{name}: vllm is a stand-in in this environment")

    kernel.__name__ = name
    return kernel
