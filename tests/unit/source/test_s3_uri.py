"""``s3://bucket/prefix`` parsed (qwen35_reshard/source/s3/store.py): the bucket and the prefix
name folders of the caches (CACHE/s3/<bucket>/<prefix>/...), so a bucket that is not an S3
bucket name (``..``) or a prefix with ``.``/``..`` parts is refused before anything is read."""

from __future__ import annotations

import pytest

from qwen35_reshard.errors import BadInput
from qwen35_reshard.source.s3.store import S3Location

from support.helpers import one_error_line, run_cli


@pytest.mark.parametrize(
    ("uri", "bucket", "prefix"),
    [
        ("s3://acc-models/qwen/tiny/", "acc-models", "qwen/tiny"),
        ("s3://my.bucket-1", "my.bucket-1", ""),
        ("s3://abc/x", "abc", "x"),
        ("s3://" + "a" * 63 + "/x", "a" * 63, "x"),
    ],
)
def test_s3_bucket_names_are_taken(uri, bucket, prefix):
    assert S3Location.parse(uri) == S3Location(bucket, prefix)


@pytest.mark.parametrize(
    "bucket", ["..", ".", "a..b", "ab", "a" * 64, "Models", "-abc", "abc-", ".abc", "abc.", "a_b", "a%2fb"]
)
def test_what_is_not_an_s3_bucket_name_is_refused_naming_the_uri(bucket):
    uri = f"s3://{bucket}/qwen/tiny"
    with pytest.raises(BadInput) as e:
        S3Location.parse(uri)
    msg = str(e.value)
    assert msg.startswith(f"{uri}: {bucket!r} is not an S3 bucket name") and "\n" not in msg, msg


@pytest.mark.parametrize("prefix", ["../x", "x/..", "x/./y", "x//y"])
def test_a_prefix_with_dot_parts_is_refused(prefix):
    with pytest.raises(BadInput, match="not an object-storage URI"):
        S3Location.parse(f"s3://models/{prefix}/")


def test_the_cli_refuses_a_bucket_out_of_the_cache_in_one_line(tmp_path):
    proc = run_cli("--pp", "2", "s3://../x", tmp_path / "out", check=False)
    line = one_error_line(proc)
    assert line.startswith("error: s3://../x: '..' is not an S3 bucket name"), line
    assert not (tmp_path / "out").exists()
