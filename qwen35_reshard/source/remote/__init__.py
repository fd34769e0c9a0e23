"""Remote reads: one fetch engine for every remote source (the Hub now, object storage next).

``parts`` (pure) turns the byte ranges a run needs into requests: near-adjacent runs coalesced,
long ones split. ``engine`` keeps many of them in flight, streams each chunk to its sink at its
offsets, retries a read from where it stopped and backs off on 429/503; a :class:`Transport`
(``engine.Transport``) is all a kind of storage implements.
"""
