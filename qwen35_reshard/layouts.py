"""How a stage's data file is laid out: the names the plan writes and the readers check.

- CLONE: exactly the bytes of one source shard the stage needs whole, header included;
- ALIGNED: one run of a shard needed in part, its bytes at their source offsets modulo
  SHARE_ALIGN (the header's space padding makes up the difference), so that a filesystem
  can share the run's blocks with the source;
- GATHERED: short runs collected into an ordinary file.

Its own module so that readers of a stage (``stage``, the loader) need not import the plan.
"""

from __future__ import annotations

CLONE, ALIGNED, GATHERED = "clone", "aligned", "gathered"
LAYOUTS = (CLONE, ALIGNED, GATHERED)
# A multiple of every block size a filesystem shares by (4 KiB pages, ZFS records up to 1 MiB).
SHARE_ALIGN = 1024 * 1024
