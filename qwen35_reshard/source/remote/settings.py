"""The fetch engine's settings from the caller and the environment, each checked into one
line naming it: how many streams, how long a read may stall, how long to wait."""

from __future__ import annotations

import os

from ...errors import BadInput, param

# huggingface_hub's snapshot_download fetches with 8 threads (max_workers=8): at least as
# many streams, no more by default (too many streams can collapse a link's throughput:
# huggingface_hub issue #4893).
DEFAULT_STREAMS = 8
STREAMS_ENV = "QWEN35_RESHARD_STREAMS"  # the servers' in-server fetch reads it (no CLI there)
# Seconds without a byte before a read counts as stalled and is asked again from its first
# missing byte. A live link delivers a chunk far more often (even 1 MB/s fills a 64 KiB chunk in
# 0.07 s); a CDN under load may pause for seconds, so a minute is only ever a dead connection
# (huggingface_hub's own downloads wait 10 s: HF_HUB_DOWNLOAD_TIMEOUT).
READ_TIMEOUT = 60.0
READ_TIMEOUT_ENV = "QWEN35_RESHARD_READ_TIMEOUT"  # shorter in tests of a stalled server


def streams_setting(streams: int | None) -> int:
    """The number of streams: ``streams`` if given, else ``QWEN35_RESHARD_STREAMS``, else
    :data:`DEFAULT_STREAMS`.

    Args:
        streams: the caller's setting (None: not set).

    Returns:
        A positive number of streams.

    Raises:
        ReshardError: the setting is not a positive integer.

    Example:
        >>> streams_setting(4)
        4
    """
    if streams is None:
        raw = os.environ.get(STREAMS_ENV, "").strip()
        if not raw:
            return DEFAULT_STREAMS
        if not raw.isdigit() or int(raw) < 1:
            raise BadInput(f"{STREAMS_ENV}={raw!r}: set it to a positive number of streams, e.g. 8")
        return int(raw)
    if streams < 1:
        raise BadInput(f"{param('streams')} must be at least 1, got {streams}")
    return streams


def read_timeout_setting() -> float:
    """Seconds a read may go without a byte: ``QWEN35_RESHARD_READ_TIMEOUT`` if set, else
    :data:`READ_TIMEOUT`; refused as :func:`seconds_setting` says.

    Example:
        >>> read_timeout_setting()
        60.0
    """
    return seconds_setting(READ_TIMEOUT_ENV, READ_TIMEOUT)


def seconds_setting(name: str, default: float) -> float:
    """A duration from the environment variable ``name`` (``default`` if unset or empty).

    Raises:
        ReshardError: not a positive number of seconds (one line naming ``name``).

    Example:
        >>> seconds_setting("QWEN35_RESHARD_UNSET_EXAMPLE", 0.5)
        0.5
    """
    raw = os.environ.get(name, "").strip()
    try:
        seconds = float(raw) if raw else default
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise BadInput(f"{name}={raw!r}: set it to a positive number of seconds, e.g. {default:g}")
    return seconds
