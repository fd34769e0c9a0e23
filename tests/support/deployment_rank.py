"""One rank of a two-node deployment, as its own process: joins a real gloo group on 127.0.0.1
and gets its stage the way the server's loader does (issue 37). Used by tests/e2e/test_deployment.py
and tests/engine/test_deployment_engines.py.

    python deployment_rank.py ADDRESS RANK '{"server": "none", "model": ..., "runtime": "vllm", ...}'

``server``: ``none`` calls :func:`rank_stage` with a plain group object over the gloo group and
an even ``pp_indices``; ``vllm`` initialises vLLM's own distributed state (world and pipeline
groups, gloo) and calls the load format's ``own_stage``; ``sglang`` initialises SGLang's and
calls the plugin's ``target_stage``. If ``wait_for`` names a file, the rank waits for it after
joining the group and before its lookup: the test's barrier, to move a branch between the ranks.
``without`` ({"RANK": [module, ...]}): modules that rank cannot import, as on a node that lacks them.
Prints ``SERVED {"rank", "commit", "how"...}`` or ``REFUSED <line>``; the loader's log lines
go to stdout as ``LOG <line>``.
"""

import json
import logging
import sys
import time
import types
from pathlib import Path

from qwen35_reshard.errors import StageError

PP = 2


def even(layers: int, rank: int, size: int) -> tuple[int, int]:
    return rank * layers // size, (rank + 1) * layers // size


def stage_of(spec: dict, address: str, rank: int) -> object:
    wait = spec.get("wait_for")
    log = lambda line: print("LOG", line, flush=True)  # noqa: E731
    layers = spec.get("layers", 8)
    if spec["server"] == "vllm":
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.distributed import parallel_state as ps

        from qwen35_reshard.servers import vllm as plugin

        with set_current_vllm_config(VllmConfig()):
            ps.init_distributed_environment(PP, rank, address, 0, "gloo")
            ps.initialize_model_parallel(1, PP)
        _wait(wait)

        config = types.SimpleNamespace(
            model=spec["model"], revision=spec.get("revision"), hf_token=None,
            hf_text_config=types.SimpleNamespace(num_hidden_layers=layers),
        )
        return plugin.own_stage(config, log=log)
    if spec["server"] == "sglang":
        from sglang.srt.distributed import parallel_state as ps
        from sglang.srt.distributed.utils import get_pp_indices
        from sglang.srt.runtime_context import SpawnRanks, get_parallel
        from sglang.srt.server_args import ServerArgs
        from sglang.test.parallel_groups import publish

        from qwen35_reshard.servers import sglang as plugin

        # SGLang's process-wide context, as its scheduler publishes it (model_path "dummy" as
        # SGLang's own tests do), then its world and pipeline groups over gloo.
        publish(ServerArgs(model_path="dummy", device="cpu", pp_size=PP), role="test",
                ranks=SpawnRanks(world_rank=rank))
        ps.init_distributed_environment(PP, rank, address, 0, "gloo")
        ps.initialize_model_parallel(backend="gloo")
        _wait(wait)
        config = types.SimpleNamespace(
            model_path=spec["model"], revision=spec.get("revision"),
            hf_text_config=types.SimpleNamespace(num_hidden_layers=layers),
        )
        return plugin.target_stage(config, get_parallel().world_group, rank, PP, get_pp_indices)
    import torch.distributed as dist

    from qwen35_reshard.servers.deployment import rank_stage

    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=PP)
    _wait(wait)
    group = types.SimpleNamespace(world_size=PP, rank_in_group=rank, cpu_group=None)
    return rank_stage(
        spec["model"], runtime=spec.get("runtime", "vllm"), group=group, pp_rank=rank, pp_size=PP,
        layers=layers, pp_indices=even, revision=spec.get("revision"), token=None, log=log,
    )


def _wait(path: str | None) -> None:
    while path is not None and not Path(path).exists():
        time.sleep(0.02)


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(message)s")
    logging.getLogger("qwen35_reshard").setLevel(logging.INFO)  # the plugin's lines, not httpx's
    address, rank, spec = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    for name in spec.get("without", {}).get(str(rank), []):  # a package this node lacks
        sys.modules[name] = None
    try:
        stage = stage_of(spec, address, rank)
    except StageError as e:
        print(f"REFUSED {e}", flush=True)
        return 3
    print("SERVED " + json.dumps({
        "rank": stage.rank, "commit": stage.manifest.source.get("commit"),
        "layers": [stage.start_layer, stage.end_layer], "path": str(stage.path),
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
