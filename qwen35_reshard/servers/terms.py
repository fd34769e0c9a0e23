"""What the servers' path says, in a server operator's terms: the one home of its wording.

Every error the vLLM load format, the SGLang plugin, the unsplit path and the deployment's
agreement can show goes through :func:`for_operator` (or :func:`operator_terms`, which has
``str()`` of an escaping error say the same): the library's parameters (:func:`~..errors.param`)
become what the operator set (the model the server was given, the stage cache and the variable
that moves it, the partition variable), and its advice (:func:`~..errors.advice`) what the
operator can do: start the server again (the stage cache resumes a build, and fetches again
what is deleted from it), delete a damaged file of the stage cache, point a variable elsewhere.
No flag of the ``qwen35-reshard`` command line, no ``out_dir``, no "run the same command".

A split given to a server (``vllm serve OUT``) is the operator's own directory, written by a
``qwen35-reshard`` run: what mends it is that tool, said without its flags (:data:`SPLIT`).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import Audience, ReshardError
from ..loader import Stage
from ..source.remote.settings import STREAMS_ENV
from ..units import format_bytes

STAGE_CACHE_ENV = "QWEN35_RESHARD_STAGE_CACHE"
PARTITION_ENVS = "VLLM_PP_LAYER_PARTITION or SGLANG_PP_LAYER_PARTITION"

# The library's parameters as an operator knows them: what the server was given, or its own
# settings. A parameter that only the command line sets is never the operator's to change: it
# is named for what it is.
_PARAMS = {
    "model_dir": "the model",
    "model": "the model",
    "source": "the model",
    "revision": "the model's revision",
    "runtime": "the server",
    "layout": "the parallel layout the server was started with",
    "pp": "the pipeline-parallel size",
    "ranks": "the pipeline rank",
    "partition": f"the layers per rank ({PARTITION_ENVS})",
    "streams": STREAMS_ENV,
    "overwrite": "the stage deleted first",
    "tp": "the tensor-parallel size",
    "ep": "the expert-parallel size",
    "nodes": "the number of nodes",
    "node": "the node",
    "redundant_experts": "the redundant experts",
    "init_expert_location": "the initial expert placement",
    "expert_location": "the initial expert placement",
    "nnodes": "the number of nodes",
    "node_rank": "the node's rank",
    "gpu_memory": "the GPU memory",
    "context_length": "the context length",
    "mem_fraction": "the memory fraction",
    "capacity": "the serving capacity",
    "max_file_bytes": "the largest file size",
    "workers": "the number of workers",
    "reflink": "the reflink setting",
    "dry_run": "a dry run",
    "repair": "a repair",
    "models": "the models",
    "older_than": "the age",
    "keep_newest": "the newest kept",
    "everything": "every entry",
}

# A stage of the stage cache, which the server builds: the next start resumes or rebuilds it.
CACHE = Audience(
    flags={**_PARAMS, "out_dir": f"the stage cache ({STAGE_CACHE_ENV})"},
    advice={
        "rerun": "start the server again",
        "rebuild": "delete it and start the server again: the stage cache builds it anew",
        "repair": "delete it and start the server again: the stage cache fetches it anew",
        "elsewhere": f"point {STAGE_CACHE_ENV} at another disk",
        "replace": "delete the stage and start the server again",
    },
)

# A split's stage given to the server: the operator's own, written by qwen35-reshard.
SPLIT = Audience(
    flags={**_PARAMS, "out_dir": "the split's directory"},
    advice={
        "rerun": "run the qwen35-reshard split that wrote it once more",
        "rebuild": "delete it and split the model into it again with qwen35-reshard",
        "repair": "restore it from the model with qwen35-reshard verify and its repair",
        "elsewhere": "split the model into another directory",
        "replace": "split the model into it again with qwen35-reshard, replacing that split",
    },
)


def for_operator(error: ReshardError, *, split: bool = False) -> str:
    """``error``'s line as a server's log says it to its operator: of a stage of the stage cache,
    or (``split``) of a split's stage the server was given.

    Example:
        >>> from qwen35_reshard.errors import ELSEWHERE, OutError, param
        >>> print(for_operator(OutError(f"{param('out_dir')} /c full; {ELSEWHERE}")))
        the stage cache (QWEN35_RESHARD_STAGE_CACHE) /c full; point QWEN35_RESHARD_STAGE_CACHE at another disk
    """
    return error.render(SPLIT if split else CACHE)


@contextmanager
def operator_terms(*, split: bool = False) -> Iterator[None]:
    """Have a :class:`~..errors.ReshardError` escaping the block say :func:`for_operator`'s line
    (its ``str()``, which the server logs), the same error raised on: its class and
    attributes are what a caller may catch."""
    try:
        yield
    except ReshardError as e:
        e.audience = SPLIT if split else CACHE
        raise


def operator_weights(stage: Stage) -> Iterator[tuple[str, object]]:
    """``stage.iter_weights()`` for a server, whose errors (a damaged byte, a file changed while
    loading) say :func:`for_operator`'s line: of a split's stage (one without ``on_damaged``,
    which the stage cache's and a stage read in place have), or of the stage cache."""
    with operator_terms(split=stage.on_damaged is None):
        yield from stage.iter_weights()


def cache_error(error: OSError, root: Path) -> str:
    """What an OSError while a rank built its stage says, naming the directory at fault: the
    file the error names, else (a write names none, e.g. a full disk) the fuller of the two
    caches a rank writes, the stage cache ``root`` and the Hugging Face cache (shards a stage
    needs whole, downloaded by huggingface_hub), each with the variable that moves it.

    Example:
        >>> import errno
        >>> cache_error(OSError(errno.EACCES, "Permission denied", "/c/x"), Path("/c"))
        'cannot write /c/x: Permission denied (the stage cache /c is set by QWEN35_RESHARD_STAGE_CACHE)'
    """
    from huggingface_hub import constants as hf

    what = error.strerror or str(error)
    if error.filename is not None:
        return f"cannot write {error.filename}: {what} (the stage cache {root} is set by {STAGE_CACHE_ENV})"
    caches = {
        root: ("the stage cache", STAGE_CACHE_ENV),
        Path(hf.HF_HUB_CACHE): ("the Hugging Face cache", "HF_HOME"),
    }
    free = {path: _free_bytes(path) for path in caches}
    path = min(caches, key=free.__getitem__)
    label, var = caches[path]
    return (
        f"{label} {path} (set by {var}): {what}, {format_bytes(free[path])} free there: free space on "
        f"that disk or point {var} at another"
    )


def _free_bytes(path: Path) -> int:
    """Free bytes on the disk of ``path`` (its nearest existing ancestor)."""
    for at in (path, *path.parents):
        try:
            return shutil.disk_usage(at).free
        except OSError:
            continue
    return 0
