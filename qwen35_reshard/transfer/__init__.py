"""Moving tensor bytes: ``copier`` (read each source byte once, hash on the way, write every
destination) and ``reflink`` (share blocks with the source instead of copying them)."""
