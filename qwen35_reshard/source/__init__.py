"""Read a source checkpoint into plain data: the index, the config and each shard's safetensors
header (``checkpoint``, ``header``), from a local directory or a remote store (``remote``: one
reader over stores, the Hub's ``hub`` and object storage's ``s3``); ``open`` takes MODEL as the
user wrote it. Nothing here reads tensor data but the fetch a run asks of a store."""
