"""Plan a split, purely from the source's plain data (no I/O): which tensor goes to which stage
(``planner``), how each stage's files are laid out (``layout``), and the balanced partition
(``balance``, sized for serving by ``capacity``)."""
