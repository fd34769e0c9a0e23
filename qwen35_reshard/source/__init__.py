"""Read a source checkpoint into plain data: the index, the config and each shard's safetensors
header (``checkpoint``, ``header``), from a local directory or a Hugging Face Hub repo (``hub``,
``ranged``); ``open`` takes MODEL as the user wrote it. Nothing here reads tensor data."""
