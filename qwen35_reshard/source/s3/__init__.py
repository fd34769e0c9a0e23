"""MODEL as an object-storage URI: ``s3://bucket/prefix`` (AWS S3, MinIO, Ceph's RADOS Gateway
and other S3-compatible stores), read through boto3 (the ``s3`` extra: ``pip install boto3``).

The prefix is listed once; each object's ETag (or version id, in a versioned bucket) is its
identity, and the checkpoint's identity (``commit``) is the sha256 of all of them: a split
records it as a Hub split records its commit, so a rerun over OUT after an object changed sees
another source. Every ranged read of an object sends ``If-Match`` with the ETag listed: an
object replaced while a run reads it is refused (412), never mixed with its old bytes.

Endpoint and credentials as every S3 tool takes them (boto3's own chain): ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and the
shared config and credentials files. A custom endpoint (an S3-compatible server) is addressed
path-style. No message, log line or file names a secret; the endpoint is redacted like a URL.

One module, ``store``: the URI, the clients, errors, the transport the fetch engine reads
through, and the listing that pins the store. Small files, headers, the checkpoint and the
fetch of a run are the remote checkpoint reader's (:mod:`..remote`), as for every store.
"""
