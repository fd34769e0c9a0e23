import pytest

from support.hub_server import HubServer
from support.remote import SHARD


@pytest.fixture
def served(make_checkpoint):
    """The tests' Hub server with the tiny checkpoint as ``Qwen/Tiny``: (server, commit, the
    bytes of SHARD)."""
    model = make_checkpoint()
    with HubServer() as hub:
        commit = hub.add_repo("Qwen/Tiny", model)
        yield hub, commit, (model / SHARD).read_bytes()
