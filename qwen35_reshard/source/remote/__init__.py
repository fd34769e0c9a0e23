"""One remote checkpoint reader, over stores (the Hub: ``..hub``; object storage: ``..s3``).

``store`` is the protocol a kind of storage implements (listing, ranged reads, identity,
errors; see its docstring for what a new store provides). Everything else is written once, for
every store: ``parts`` (pure) turns the byte ranges a run needs into requests; ``engine`` keeps
many of them in flight, streams each chunk to its sink at its offsets, retries a read from where
it stopped and backs off on 429/503; ``checkpoint`` reads the config, index, small files and
every shard's header at once and assembles the checkpoint; ``fetch`` hands the copy each shard
of a run (a local copy, or the engine's ranges).
"""
