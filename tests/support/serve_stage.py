"""Run ``qwen35_reshard.servers.unsplit.server_stage`` in its own process (HF_HOME, HF_ENDPOINT and the
stage cache are the caller's environment, read by huggingface_hub at import) and print what
it gave: ``RESULT {how, fetched_bytes, where, files, path, digests: {name: sha256 of bytes}}``,
or ``STAGEERROR <message>`` (opening or loading the stage) and exit 3. Used by tests/e2e/test_serve.py.

    python serve_stage.py '{"model": ..., "runtime": "vllm", "partition": [2, 2, 2, 2], "rank": 1}'

``"ep"``, ``"nodes"`` and ``"node"``: expert parallelism, the rank's node of its stage.

``"hold": SECONDS`` keeps it running that long after RESULT, as a server serving the stage.
``"stop_after_open": true`` stops the process (SIGSTOP) once its stage is opened, for a test
to act there and SIGCONT it.
"""

import hashlib
import json
import os
import signal
import sys
import time

import torch

from qwen35_reshard.loader import StageError
from qwen35_reshard.model.parallelism import Parallelism
from qwen35_reshard.servers import unsplit
from qwen35_reshard.servers.unsplit import server_stage


def main() -> int:
    spec = json.loads(sys.argv[1])
    if spec.get("stop_after_open"):
        opened = unsplit.open_stage

        def open_then_stop(*args, **kwargs):
            stage = opened(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGSTOP)
            return stage

        unsplit.open_stage = open_then_stop
    try:
        served = server_stage(
            spec["model"],
            Parallelism(len(spec["partition"]), spec["runtime"], tuple(spec["partition"]),
                        ep=spec.get("ep", 1), nodes=spec.get("nodes", 1)),
            rank=spec["rank"], node=spec.get("node", 0),
            revision=spec.get("revision"), token=spec.get("token"), copy=spec.get("copy", False),
            user_agent=spec.get("user_agent"),
        )
    except StageError as e:
        print(f"STAGEERROR {e}", flush=True)
        return 3
    stage = served.stage
    try:  # the load checks every byte: a damaged one stops it
        digests = {
            name: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            for name, t in stage.iter_weights()
        }
    except StageError as e:
        print(f"STAGEERROR {e}", flush=True)
        return 3
    print("RESULT " + json.dumps({
        "how": served.how, "fetched_bytes": served.fetched_bytes,
        "where": None if served.where is None else str(served.where), "files": list(stage.files),
        "path": str(stage.path), "digests": digests, "line": served.describe(),
    }), flush=True)
    time.sleep(spec.get("hold", 0))  # a server running on the stage, until killed
    return 0


if __name__ == "__main__":
    sys.exit(main())
