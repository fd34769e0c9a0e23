import pytest

from support.hub_server import HubServer
from support.remote import SHARD, STORES, served_hub, served_s3
from support.s3_server import S3Server


@pytest.fixture
def served(make_checkpoint):
    """The tests' Hub server with the tiny checkpoint as ``Qwen/Tiny``: (server, commit, the
    bytes of SHARD)."""
    model = make_checkpoint()
    with HubServer() as hub:
        commit = hub.add_repo("Qwen/Tiny", model)
        yield hub, commit, (model / SHARD).read_bytes()


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server (one per module: moto's state is the process's, and a new server resets it)."""
    with S3Server() as server:
        yield server


@pytest.fixture(params=STORES)
def store(request, make_checkpoint, monkeypatch):
    """SHARD of the tiny checkpoint on each store's server in turn (support.remote.Served)."""
    model = make_checkpoint()
    if request.param == "hub":
        yield from served_hub(model)
    else:
        yield served_s3(request.getfixturevalue("s3_server"), model, monkeypatch)
