"""MODEL as a Hugging Face Hub repo id: a store (:mod:`..remote.store`) pinned to one commit.

A repo id (``org/name``) is resolved once to a commit; every later request names that commit,
so a branch moving during a run cannot mix two versions. The rest is the remote checkpoint
reader's (:mod:`..remote.checkpoint`, :mod:`..remote.fetch`), as for every store: config, index
and each shard's header by ranged reads, kept in huggingface_hub's cached-assets folder by
commit (planning the same commit again needs no network), the stages' bytes through the fetch
engine. Files already in the Hugging Face cache are read there; with ``hf_cache`` shards needed
whole are downloaded into it (other tools reuse them).

Offline (``offline=True`` or ``HF_HUB_OFFLINE=1``) only the cache and the kept files are used,
and a run that needs more names exactly the files missing. The token (``token=``, ``HF_TOKEN``
or the saved login, as huggingface_hub finds it) goes to the Hub's own origin only; it is never
printed, logged or written anywhere. No message (ours, or huggingface_hub's own log lines)
names a URL with its query string: a presigned CDN address carries its signature there (see
:func:`..ranged.redact`).

Modules, each importing only those before it: ``cache`` (settings, the cache's refs), ``http``
(huggingface_hub's requests: redaction, retries, downloads, errors) and ``store`` (the store:
listing, ranged reads, local copies, resolving a revision).
"""
