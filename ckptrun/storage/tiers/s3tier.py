"""The tier on an S3-compatible object store (`s3://bucket/prefix`), through boto3.

boto3 was chosen over obstore and s3fs: on the loopback endpoint all three are bound by the
server, but boto3 alone exposes the listing of a bucket's unfinished multipart uploads (how a
dead run's partial uploads are found and aborted), per-part CRC32 checksums that the store
checks on arrival, and separate connect timeouts and retry counts (a start-up probe answers in
seconds; uploads retry). Objects above PART bytes go up as multipart uploads, PARALLEL parts at
a time, read in order from the source so its span checksums see every byte.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from ...errors import CkptrunError, CorruptCheckpoint
from ..fsutil import _no_fault
from .base import Tier, UploadFault
from .source import Source

PART = 8 << 20
PARALLEL = 4
EXTRA = "pip install 'ckptrun[s3]'"


def _boto3() -> Any:
    try:
        import boto3
    except ImportError:
        raise CkptrunError(f"s3:// URLs need the s3 extra: {EXTRA}", exit_code=2) from None
    return boto3


def parse(url: str) -> tuple[str, str]:
    """(bucket, prefix) of `s3://bucket/prefix`; a one-line error for anything else."""
    rest = url.removeprefix("s3://")
    bucket, _, prefix = rest.partition("/")
    parts = [p for p in prefix.split("/") if p]
    if not bucket or any(p in (".", "..") for p in parts):
        raise CkptrunError(f"{url}: expected s3://BUCKET/PREFIX", exit_code=2)
    return bucket, "/".join(parts)


class S3Tier(Tier):
    """Records under `s3://bucket/prefix/`; `endpoint`: an S3-compatible service's URL."""

    def __init__(self, url: str, endpoint: str | None = None) -> None:
        self.url, self.endpoint = url, endpoint or None
        self.bucket, self.prefix = parse(url)
        self._base = f"{self.prefix}/" if self.prefix else ""
        self.client = self._client(connect_timeout=10, read_timeout=120, attempts=5)

    def _client(self, *, connect_timeout: float, read_timeout: float, attempts: int) -> Any:
        from botocore.config import Config

        cfg = Config(connect_timeout=connect_timeout, read_timeout=read_timeout, max_pool_connections=2 * PARALLEL,
                     retries={"max_attempts": attempts, "mode": "standard"})
        # a session of its own: the credential chain as it is now (boto3's default session keeps the first)
        return _boto3().session.Session().client("s3", endpoint_url=self.endpoint, config=cfg)

    def probe(self, write: bool = True) -> None:
        """Head the bucket (and, with `write`, write and delete one object), with a short
        timeout and one retry."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        where = self.url + (f" (endpoint {self.endpoint})" if self.endpoint else "")  # (run's --durable, or a --dir)
        client = self._client(connect_timeout=2, read_timeout=5, attempts=2)
        key = f"{self._base}.probe-ckptrun"
        try:
            client.head_bucket(Bucket=self.bucket)
            if write:
                client.put_object(Bucket=self.bucket, Key=key, Body=b"ok")
                client.delete_object(Bucket=self.bucket, Key=key)
        except NoCredentialsError:
            raise CkptrunError(f"{where}: no credentials found (set AWS_ACCESS_KEY_ID and "
                               "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)", exit_code=2) from None
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("404", "NoSuchBucket") or status == 404:
                why = f"bucket {self.bucket} does not exist"
            elif status in (401, 403):
                why = f"credentials refused ({code})"
            else:
                why = f"the store answered {code or status}"
            raise CkptrunError(f"{where}: {why}", exit_code=2) from None
        except BotoCoreError as e:
            raise CkptrunError(f"{where}: cannot reach the store ({type(e).__name__})", exit_code=2) from None

    def _list(self) -> list[tuple[str, int]]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._base)
        return [(o["Key"][len(self._base):], int(o["Size"])) for page in pages for o in page.get("Contents", [])]

    def put(self, key: str, src: Source, fault: UploadFault = _no_fault) -> None:
        full = self._base + key
        if src.nbytes <= PART:
            self.client.put_object(Bucket=self.bucket, Key=full, Body=b"".join(src.chunks(PART)),
                                   ChecksumAlgorithm="CRC32")
            return
        upload = self.client.create_multipart_upload(Bucket=self.bucket, Key=full, ChecksumAlgorithm="CRC32")
        uid = upload["UploadId"]
        try:
            parts = self._parts(full, uid, src, fault)
            self.client.complete_multipart_upload(Bucket=self.bucket, Key=full, UploadId=uid,
                                                  MultipartUpload={"Parts": parts})
        except Exception:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=uid)
            raise

    def _parts(self, key: str, uid: str, src: Source, fault: UploadFault) -> list[dict]:
        """Upload `src` as the parts of upload `uid`, at most PARALLEL in flight (bounded memory)."""
        def one(number: int, body: bytes) -> dict:
            r = self.client.upload_part(Bucket=self.bucket, Key=key, UploadId=uid, PartNumber=number, Body=body,
                                        ChecksumAlgorithm="CRC32")
            return {"PartNumber": number, "ETag": r["ETag"], "ChecksumCRC32": r["ChecksumCRC32"]}

        done: list = []

        def collect(futures: set) -> None:
            for f in futures:
                done.append(f.result())
                fault("part")

        with ThreadPoolExecutor(PARALLEL) as pool:
            running: set = set()
            for number, body in enumerate(src.chunks(PART), 1):
                if len(running) >= PARALLEL:
                    finished, running = wait(running, return_when=FIRST_COMPLETED)
                    collect(finished)
                running.add(pool.submit(one, number, bytes(body)))  # (a view of a buffer: botocore takes bytes)
            collect(running)
        return sorted(done, key=lambda p: p["PartNumber"])

    def get(self, key: str, dest: Path, size: int) -> None:
        from boto3.s3.transfer import TransferConfig

        self.client.download_file(self.bucket, self._base + key, str(dest),
                                  Config=TransferConfig(multipart_chunksize=PART, max_concurrency=PARALLEL))
        if dest.stat().st_size != size:
            raise CorruptCheckpoint(f"{self.url}: {key} changed while read ({dest.stat().st_size} bytes, "
                                    f"listed {size})")

    def delete(self, keys: list[str]) -> None:
        for key in keys:  # one by one, in order (a commit object goes before what it names)
            self.client.delete_object(Bucket=self.bucket, Key=self._base + key)

    def sweep_partial(self) -> int:
        pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=self._base)
        uploads = [u for page in pages for u in page.get("Uploads", [])]
        for u in uploads:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"])
        return len(uploads)
