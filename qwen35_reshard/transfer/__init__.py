"""Moving tensor bytes: ``copier`` (read each source byte once, hash on the way, write every
destination), cutting what it moves into windows and runs (``segments``), hashing beside it
(``hasher``), streaming through the page cache (``pages``), and ``reflink`` (share blocks with
the source instead of copying them)."""
