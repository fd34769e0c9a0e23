"""The unsplit path's messages in a server operator's terms (qwen35_reshard/servers/unsplit.py,
issue 37): a stage read in place is the user's own checkpoint, never to be deleted; the
library's parameters and advice become the stage cache, its variable and the server's next
start. (A full disk and a refused token: tests/e2e/test_serve.py.)"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest

from qwen35_reshard.errors import OutError, StageError, param
from qwen35_reshard.model.parallelism import Parallelism
from qwen35_reshard.servers.unsplit import STAGE_CACHE_ENV, cache_error, server_stage, server_terms


def test_a_shard_read_in_place_that_changes_while_loading_is_not_to_be_deleted(make_checkpoint, tmp_path):
    model = shutil.copytree(make_checkpoint(), tmp_path / "model")
    layout = Parallelism(pp=2, runtime="vllm", partition=(4, 4))
    served = server_stage(model, layout, rank=1, cache=tmp_path / "stages")
    assert served.how == "in place"
    shard = Path(model) / served.stage.files[0]
    with open(shard, "ab") as f:  # the checkpoint rewritten while the server starts
        f.write(b"\0" * 8)
    with pytest.raises(StageError) as e:
        for _ in served.stage.iter_weights():
            pass
    message = str(e.value)
    assert "changed while loading" in message and "checkpoint's own file" in message, message
    assert "delete" not in message and "same" not in message, message


def test_library_errors_read_in_the_servers_terms():
    error = OutError(
        f"{param('out_dir')} /c: no space left; free space and run the same qwen35-reshard command again "
        "or choose another directory"
    )
    assert server_terms(error) == (
        f"the stage cache ({STAGE_CACHE_ENV}) /c: no space left; free space and start the server again "
        f"or point {STAGE_CACHE_ENV} at another disk"
    )


def test_an_os_error_names_its_file_or_the_fuller_cache(tmp_path):
    named = cache_error(OSError(errno.EACCES, "Permission denied", str(tmp_path / "x")), tmp_path)
    assert named.startswith(f"cannot write {tmp_path / 'x'}: Permission denied") and STAGE_CACHE_ENV in named
    # No file named (a write on a full disk): the cache with less free space; the stage cache
    # here is a path on no disk at all (0 bytes free), so it is the one named.
    nowhere = Path("/proc/no/such/cache")
    unnamed = cache_error(OSError(errno.ENOSPC, "No space left on device"), nowhere)
    assert unnamed.startswith(f"the stage cache {nowhere} (set by {STAGE_CACHE_ENV}): No space left"), unnamed
