"""What the copy moves: each tensor's source byte range and destinations (:class:`Segment`),
cut into windows of the source and runs of bytes to move."""

from __future__ import annotations

from collections.abc import Container, Iterator
from dataclasses import dataclass, field

# Windows of runs that are only shared, never read, in chunks: they take no memory, and a
# window is the unit of progress and of stopping (a copy, if sharing is refused, of 1 GiB).
LONG_WINDOW_CHUNKS = 128


@dataclass
class Segment:
    """One source tensor to copy: its source byte range and where each copy goes."""

    name: str
    offset: int  # absolute offset in the source file
    nbytes: int
    dests: list[tuple[int, int]] = field(default_factory=list)  # (output fd, absolute offset)


# A piece of a segment inside one window: (segment, absolute begin, absolute end).
Piece = tuple[Segment, int, int]
# Bytes to move: (output fd, source offset, length, output offset).
Run = tuple[int, int, int, int]


def source_spans(segments: list[Segment]) -> list[tuple[int, int]]:
    """Runs ``[begin, end)`` of source-adjacent, non-empty segments (sorted by offset)."""
    spans: list[list[int]] = []
    for s in segments:
        if not s.nbytes:
            continue
        if spans and spans[-1][1] == s.offset:
            spans[-1][1] += s.nbytes
        else:
            spans.append([s.offset, s.offset + s.nbytes])
    return [(a, b) for a, b in spans]


def windows(
    segments: list[Segment], chunk_bytes: int, *, long_windows: Container[str] = ()
) -> Iterator[tuple[int, int, list[Piece]]]:
    """Cut runs of source-adjacent, non-empty segments into windows of at most ``chunk_bytes``.

    Yields ``(position, length, pieces)``; gaps between runs (tensors this run does not
    need) are skipped, never read. Windows end at multiples of ``chunk_bytes`` of the source
    offset, so that they cut runs at the same place whatever the run's start. Runs of segments
    named in ``long_windows`` (shared, never read) are cut every ``LONG_WINDOW_CHUNKS`` chunks
    instead: one sharing call where there would be hundreds.
    """
    segs = [s for s in segments if s.nbytes]
    long = [s.name in long_windows for s in segs]
    i = 0
    while i < len(segs):
        j = i + 1
        while j < len(segs) and long[j] == long[i] and segs[j].offset == _end(segs[j - 1]):
            j += 1
        span = segs[i:j]
        k, pos, end = 0, span[0].offset, span[-1].offset + span[-1].nbytes
        window = chunk_bytes * LONG_WINDOW_CHUNKS if long[i] else chunk_bytes
        while pos < end:
            chunk_end = min((pos // window + 1) * window, end)
            pieces: list[Piece] = []
            while k < len(span) and span[k].offset < chunk_end:
                seg = span[k]
                seg_end = seg.offset + seg.nbytes
                pieces.append((seg, max(seg.offset, pos), min(seg_end, chunk_end)))
                if seg_end > chunk_end:
                    break  # continues in the next window
                k += 1
            yield pos, chunk_end - pos, pieces
            pos = chunk_end
        i = j


def _end(s: Segment) -> int:
    return s.offset + s.nbytes


def piece_runs(pieces: list[Piece]) -> list[Run]:
    """``(out fd, source offset, length, output offset)`` for each piece's destinations,
    merging runs that are adjacent both in the source and in the same output file."""
    runs: list[list[int]] = []
    last: dict[int, list[int]] = {}
    for seg, a, b in pieces:
        for out_fd, out_off in seg.dests:
            dst = out_off + (a - seg.offset)
            r = last.get(out_fd)
            if r is not None and r[1] + r[2] == a and r[3] + r[2] == dst:
                r[2] += b - a
            else:
                r = last[out_fd] = [out_fd, a, b - a, dst]
                runs.append(r)
    return [(r[0], r[1], r[2], r[3]) for r in runs]
