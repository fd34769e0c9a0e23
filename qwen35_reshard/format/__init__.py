"""The on-disk format, a leaf: what the tool reads and writes, without how it is built.

One job per module: ``names`` (file names, patterns, layouts), ``dtypes`` (safetensors dtypes),
``jsonio`` (deterministic JSON and its checked reading), ``paths`` (what a file name may be and
where it may resolve), ``manifest`` (the manifests' format strings and field names) and
``identity`` (the run identity as plain data). It imports nothing of the package but
``errors`` and ``_version``; building a manifest from a plan is the writer's
(``write.manifest``), parsing one the stage reader's (``stage.manifest``).
"""
