"""Plan a split, purely from the source's plain data (no I/O): which tensor goes to which stage and
file (``planner``), and the balanced partition (``balance``, sized for serving by ``capacity``)."""
