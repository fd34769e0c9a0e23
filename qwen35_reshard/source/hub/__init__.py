"""MODEL as a Hugging Face Hub repo id: plan from remote headers, fetch only what stages need.

A repo id (``org/name``) is resolved once to a commit; every later request names that commit,
so a branch moving during a run cannot mix two versions. Planning reads ``config.json`` and the
index through huggingface_hub (into its standard cache) and each shard's safetensors header
through two small HTTP range requests (the first bytes, then exactly the rest of the header).
Headers and the repo's file list are kept in huggingface_hub's cached-assets folder, keyed by
repo and commit, so planning the same commit again needs no network.

A split then fetches per source shard, for the stages being built:

- ``cache``: the shard is already in the Hugging Face cache: read there;
- ``whole``: the stages need every tensor of it: downloaded whole by huggingface_hub into the
  standard cache (other tools reuse it), then read like a local file;
- ``ranges``: the shard straddles a stage boundary: only the needed tensors' byte ranges are
  fetched (:mod:`..ranged`) and streamed straight into the stage files; the cache never sees
  these partial bytes.

Offline (``offline=True`` or ``HF_HUB_OFFLINE=1``) only the cache and the kept headers are
used, and a run that needs more names exactly the files missing. The token (``token=``,
``HF_TOKEN`` or the saved login, as huggingface_hub finds it) is passed to huggingface_hub and
to the Hub's own origin only; it is never printed, logged or written anywhere.

Every request to the Hub (resolving the revision, the file list, small files, whole shards,
ranged reads) answered ``408``, ``429`` or ``5xx`` is tried again with backoff, ``RETRIES`` times
at most, each retry logged as a warning (stderr by default). No message (ours, or
huggingface_hub's own log lines about these requests) names a URL with its query string: a
presigned CDN address carries its signature there (see :func:`..ranged.redact`).

Modules, each importing only those before it: ``cache`` (settings, the pinned repo and its
paths, the files kept there), ``http`` (requests: counting, redaction, retries, resolving,
downloads, ranged readers, errors), ``listing`` (the repo's files), ``headers`` (each shard's
header), ``checkpoint`` (the checkpoint as plain data) and ``fetch`` (how each shard is fetched).
"""
