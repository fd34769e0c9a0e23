"""Execute a plan: write the stage directories crash-safe and resumable (``writer``), and mend a
damaged split from its source (``repair``).

Those two are the package's entry points; the rest are the writer's rooms, each readable alone:
``assess`` (what a run does with an existing OUT), ``outdir`` (making OUT ready), ``assemble``
(the data files, one worker per source shard) on ``datafile`` (one file's header, clone or
creation) and ``journal`` (what a resumed run keeps), ``finish`` (side files, manifests,
indexes), ``durability`` (barriers, atomic writes, temporary files) beneath them all, and
``claims`` (runs sharing one OUT: its lock, stage claims, proving a run gone) beneath that.
"""
