"""Which S3 client library to read byte ranges with: measured, not guessed (issue 38).

Starts ``tests/support/s3_server.py`` (moto's S3 server, signatures checked) in a process of its
own, paced like a wide-area link (``--rate`` bytes/s per request, ``--latency`` s before each
answer) and, for comparison, unpaced on loopback; uploads one object of ``--size`` bytes; then each
candidate client reads the whole object as ``--part``-byte ranges with ``--streams`` requests in
flight, in interleaved rounds, and reports the median MB/s and requests per second:

- ``boto3``: ``get_object(Range=...)`` from a thread pool, one client shared (botocore's
  connection pool sized to the streams);
- ``obstore``: ``obstore.get_range`` from the same thread pool (the Rust client releases the GIL),
  and ``obstore.get_ranges`` (its own concurrency and coalescing, one call);
- ``s3fs``: ``cat_ranges`` (aiobotocore, its own event loop);
- baseline: boto3's own whole-object download (``download_fileobj``, its TransferManager with
  ``--streams`` threads and ``--part`` chunks), what ``aws s3 cp`` does.

The candidates that are not installed are skipped with a line saying so:
``pip install boto3 obstore s3fs 'moto[server]'``.

    python -m benchmarks s3_clients                          # 64 MB, 8 MB parts, 8 streams
    python -m benchmarks s3_clients --rate 10e6 --latency 0.03 --rounds 3
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.lib.links import s3_server
from benchmarks.lib.trees import Tree

QUICK = ["--size", "4e6", "--part", "1e6", "--rounds", "1", "--rate", "0"]
BEFORE = False  # it measures client libraries, not this package
BUCKET, KEY = "bench", "model/blob.safetensors"


def boto_client(info: dict, streams: int) -> object:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=info["endpoint"],
        region_name="us-east-1",
        aws_access_key_id=info["access_key"],
        aws_secret_access_key=info["secret_key"],
        config=Config(max_pool_connections=streams, s3={"addressing_style": "path"}),
    )


def parts(size: int, part: int) -> list[tuple[int, int]]:
    return [(b, min(b + part, size)) for b in range(0, size, part)]


def read_boto3(info: dict, size: int, part: int, streams: int) -> int:
    s3 = boto_client(info, streams)

    def one(r: tuple[int, int]) -> int:
        body = s3.get_object(Bucket=BUCKET, Key=KEY, Range=f"bytes={r[0]}-{r[1] - 1}")["Body"]
        return len(body.read())

    with ThreadPoolExecutor(streams) as pool:
        return sum(pool.map(one, parts(size, part)))


def _obstore(info: dict) -> object:
    from obstore.store import S3Store

    return S3Store(
        BUCKET,
        endpoint=info["endpoint"],
        region="us-east-1",
        access_key_id=info["access_key"],
        secret_access_key=info["secret_key"],
        client_options={"allow_http": True},
        virtual_hosted_style_request=False,
    )


def read_obstore_threads(info: dict, size: int, part: int, streams: int) -> int:
    import obstore

    store = _obstore(info)

    def one(r: tuple[int, int]) -> int:
        return len(obstore.get_range(store, KEY, start=r[0], end=r[1]))

    with ThreadPoolExecutor(streams) as pool:
        return sum(pool.map(one, parts(size, part)))


def read_obstore_ranges(info: dict, size: int, part: int, streams: int) -> int:
    import obstore

    store = _obstore(info)
    spans = parts(size, part)
    got = obstore.get_ranges(store, KEY, starts=[b for b, _ in spans], ends=[e for _, e in spans])
    return sum(len(g) for g in got)


def read_s3fs(info: dict, size: int, part: int, streams: int) -> int:
    import s3fs

    fs = s3fs.S3FileSystem(
        key=info["access_key"],
        secret=info["secret_key"],
        endpoint_url=info["endpoint"],
        client_kwargs={"region_name": "us-east-1"},
        max_concurrency=streams,
        skip_instance_cache=True,
    )
    spans = parts(size, part)
    path = f"{BUCKET}/{KEY}"
    got = fs.cat_ranges([path] * len(spans), [b for b, _ in spans], [e for _, e in spans], batch_size=streams)
    return sum(len(g) for g in got)


def download_boto3(info: dict, size: int, part: int, streams: int) -> int:
    from boto3.s3.transfer import TransferConfig

    s3 = boto_client(info, streams)
    sink = io.BytesIO()
    cfg = TransferConfig(multipart_chunksize=part, max_concurrency=streams, multipart_threshold=part)
    s3.download_fileobj(BUCKET, KEY, sink, Config=cfg)
    return sink.getbuffer().nbytes


CANDIDATES = {
    "boto3 ranges (threads)": ("boto3", read_boto3),
    "obstore get_range (threads)": ("obstore", read_obstore_threads),
    "obstore get_ranges": ("obstore", read_obstore_ranges),
    "s3fs cat_ranges": ("s3fs", read_s3fs),
    "boto3 download_fileobj (whole object)": ("boto3", download_boto3),
}


def installed(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def measure(label: str, rate: float | None, latency: float, a: argparse.Namespace) -> None:
    with s3_server(rate, latency) as info:
        s3 = boto_client(info, 1)
        s3.create_bucket(Bucket=BUCKET)
        s3.put_object(Bucket=BUCKET, Key=KEY, Body=os.urandom(a.size))
        runs = {name: [] for name, (mod, _) in CANDIDATES.items() if installed(mod)}
        for name, (mod, _) in CANDIDATES.items():
            if name not in runs:
                print(f"  (skipped {name}: {mod} is not installed)")
        for _ in range(a.rounds):
            for name in runs:
                fn = CANDIDATES[name][1]
                t = time.perf_counter()
                n = fn(info, a.size, a.part, a.streams)
                runs[name].append(time.perf_counter() - t)
                assert n == a.size, (name, n)
        requests = -(-a.size // a.part)
        base = (
            statistics.median(runs["boto3 download_fileobj (whole object)"])
            if "boto3 download_fileobj (whole object)" in runs
            else None
        )
        print(
            f"\n### {label}: {a.size / 1e6:.0f} MB, {a.part / 1e6:.0f} MB parts, {a.streams} in flight, "
            f"{a.rounds} rounds\n"
        )
        print("| client | median s | MB/s | requests/s | time / boto3 whole-object |")
        print("|---|---:|---:|---:|---:|")
        for name, times in runs.items():
            t = statistics.median(times)
            ratio = f"{t / base:.2f}" if base else "-"
            print(f"| {name} | {t:.2f} | {a.size / t / 1e6:.0f} | {requests / t:.1f} | {ratio} |")


def main(argv: list[str], trees: list[Tree]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks s3_clients", description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=float, default=64e6)
    ap.add_argument("--part", type=float, default=8e6)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", type=float, default=10e6, help="paced link: bytes/s per request")
    ap.add_argument("--latency", type=float, default=0.03, help="paced link: seconds before each answer")
    a = ap.parse_args(argv)
    a.size, a.part = int(a.size), int(a.part)
    if a.rate:
        measure(
            f"paced ({a.rate / 1e6:.0f} MB/s per request, {a.latency * 1e3:.0f} ms)", a.rate, a.latency, a
        )
    measure("loopback, unpaced", None, 0.0, a)
    return 0
