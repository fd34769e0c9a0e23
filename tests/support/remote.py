"""The fetch engine over the Hub's HTTP transport, pointed at the tests' Hub server: what the
unit tests of the transport and of the engine read through."""

from __future__ import annotations

from huggingface_hub import get_session, hf_hub_url
from huggingface_hub.utils import hf_raise_for_status

from qwen35_reshard.source.ranged import HttpTransport
from qwen35_reshard.source.remote.engine import FetchEngine, RetryPolicy

SHARD = "model-00002-of-00004.safetensors"  # a shard of the tests' tiny checkpoint


def hub_engine(hub, commit: str, *, streams: int = 4, counter=None, headers=None) -> FetchEngine:
    """An engine reading ``Qwen/Tiny`` at ``commit`` from ``hub``, retrying after 0.05 s."""
    transport = HttpTransport(
        lambda name: hf_hub_url("Qwen/Tiny", name, revision=commit, endpoint=hub.url),
        display="Qwen/Tiny",
        session=get_session(),
        headers=headers or {},
        raise_for_status=hf_raise_for_status,
        counter=counter,
    )
    return FetchEngine(transport, streams=streams, policy=RetryPolicy(wait=0.05))
