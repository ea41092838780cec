#!/usr/bin/env bash
# S3 compatibility check of an ObjectCache server with awscli and boto3 (SigV4, path-style).
# Usage: scripts/awscli-test.sh ENDPOINT ACCESS_KEY SECRET_KEY [VENV_DIR]
# Puts, lists and gets objects (whole and ranged), checks conditional PUT, and checks that
# bad credentials are rejected. Exits non-zero on the first failure.
set -euo pipefail
endpoint="$1" access="$2" secret="$3"
venv="${4:-${OBJECTCACHE_AWS_VENV:-target/awscli-venv}}"
export AWS_ACCESS_KEY_ID="$access" AWS_SECRET_ACCESS_KEY="$secret" AWS_DEFAULT_REGION=us-east-1
export AWS_EC2_METADATA_DISABLED=true AWS_CONFIG_FILE=/dev/null AWS_SHARED_CREDENTIALS_FILE=/dev/null
aws() { "$venv/bin/aws" --endpoint-url "$endpoint" "$@"; }
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
bucket="awscli-$$"

# awscli: bucket, put, list, get.
aws s3api create-bucket --bucket "$bucket" >/dev/null
head -c 3000000 /dev/urandom > "$tmp/obj"
aws s3 cp "$tmp/obj" "s3://$bucket/dir/obj" --quiet
aws s3 ls "s3://$bucket/dir/" | grep -q ' 3000000 obj'
aws s3 cp "s3://$bucket/dir/obj" "$tmp/back" --quiet
cmp "$tmp/obj" "$tmp/back"
aws s3api list-buckets --query 'Buckets[].Name' --output text | grep -q "$bucket"
echo "awscli: create-bucket, cp up, ls, cp down, list-buckets OK"

# boto3: ranged GET, conditional PUT, ListObjectsV2 pagination, delete, bad credentials.
"$venv/bin/python" - "$endpoint" "$bucket" "$access" "$secret" "$tmp/obj" <<'PY'
import sys, boto3, botocore
from botocore.config import Config
endpoint, bucket, access, secret, path = sys.argv[1:]
cfg = Config(signature_version="s3v4", s3={"addressing_style": "path"}, retries={"max_attempts": 1})
s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=access, aws_secret_access_key=secret,
                  region_name="us-east-1", config=cfg)
data = open(path, "rb").read()
r = s3.get_object(Bucket=bucket, Key="dir/obj", Range="bytes=1000-1999")
assert r["Body"].read() == data[1000:2000], "ranged GET"
assert r["ResponseMetadata"]["HTTPStatusCode"] == 206, r["ResponseMetadata"]["HTTPStatusCode"]
s3.put_object(Bucket=bucket, Key="once", Body=b"first", IfNoneMatch="*")
try:
    s3.put_object(Bucket=bucket, Key="once", Body=b"second", IfNoneMatch="*")
    raise SystemExit("conditional PUT over an existing object succeeded")
except botocore.exceptions.ClientError as e:
    assert e.response["Error"]["Code"] in ("PreconditionFailed", "412"), e.response
assert s3.get_object(Bucket=bucket, Key="once")["Body"].read() == b"first"
for i in range(5):
    s3.put_object(Bucket=bucket, Key=f"page/{i}", Body=b"x" * i)
keys, token = [], None
while True:
    kw = {"Bucket": bucket, "Prefix": "page/", "MaxKeys": 2}
    if token:
        kw["ContinuationToken"] = token
    r = s3.list_objects_v2(**kw)
    keys += [o["Key"] for o in r.get("Contents", [])]
    if not r["IsTruncated"]:
        break
    token = r["NextContinuationToken"]
assert keys == [f"page/{i}" for i in range(5)], keys
h = s3.head_object(Bucket=bucket, Key="dir/obj")
assert h["ContentLength"] == len(data)
s3.delete_object(Bucket=bucket, Key="once")
try:
    s3.head_object(Bucket=bucket, Key="once")
    raise SystemExit("deleted object still there")
except botocore.exceptions.ClientError as e:
    assert e.response["Error"]["Code"] in ("404", "NoSuchKey"), e.response
bad = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=access, aws_secret_access_key=secret + "x",
                   region_name="us-east-1", config=cfg)
for call in (lambda: bad.list_objects_v2(Bucket=bucket), lambda: bad.put_object(Bucket=bucket, Key="evil", Body=b"x")):
    try:
        call()
        raise SystemExit("bad credentials accepted")
    except botocore.exceptions.ClientError as e:
        assert e.response["ResponseMetadata"]["HTTPStatusCode"] == 403, e.response
unknown = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="nobody", aws_secret_access_key="nothing",
                       region_name="us-east-1", config=cfg)
try:
    unknown.list_buckets()
    raise SystemExit("unknown access key accepted")
except botocore.exceptions.ClientError as e:
    assert e.response["ResponseMetadata"]["HTTPStatusCode"] == 403, e.response
print("boto3: ranged GET (206), conditional PUT (412), ListObjectsV2 pagination, HEAD, DELETE, bad credentials rejected (403) OK")
PY
echo "S3 compatibility check passed against $endpoint"
