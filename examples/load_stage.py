"""Load one pipeline stage through the shim, the way a server's weight loading would.

    python3 examples/load_stage.py OUT RANK [--server-partition 2,2,2,2] [--verify]

Opens OUT/pp{RANK}, checks it against the layer range the server computes for itself (from
``--server-partition``, or the server's default split when the partition variable is unset),
and streams exactly the stage's tensors. Run it with a partition other than the split's to see
what the shim says when a server was launched without the right *_PP_LAYER_PARTITION.
Needs torch.
"""

from __future__ import annotations

import argparse
import sys

from qwen35_reshard import loader
from qwen35_reshard.errors import ReshardError
from qwen35_reshard.model.runtimes import default_partition, layer_ranges


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the split's output directory (or a stage directory with RANK)")
    p.add_argument("rank", type=int, help="this server's pipeline rank")
    p.add_argument(
        "--server-partition",
        help="the split the server uses; default: the server's own default split, as when the "
        "partition variable is unset",
    )
    p.add_argument("--verify", action="store_true", help="re-hash every tensor against the manifest")
    args = p.parse_args(argv)
    try:
        stage = loader.open_stage(args.out, pp_rank=args.rank)
        if args.server_partition:
            partition = [int(n) for n in args.server_partition.split(",")]
        else:
            partition = default_partition(stage.num_layers, stage.pp, stage.runtime)
        start, end = layer_ranges(partition)[args.rank]
        stage.check(pp_size=len(partition), start_layer=start, end_layer=end, pp_rank=args.rank)
        count = nbytes = 0
        for _name, tensor in stage.iter_weights(verify=args.verify):
            count += 1
            nbytes += tensor.numel() * tensor.element_size()
    except ReshardError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{stage.display}: layers [{start}, {end}), {count} tensors, {nbytes} bytes loaded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
