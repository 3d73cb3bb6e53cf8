"""An S3-compatible endpoint on the loopback interface for the tests: moto's standalone server,
started as a subprocess on a free port, with authentication on (an IAM user made through its
first unauthenticated calls), so that wrong credentials are refused as a real store does."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

SETUP_CALLS = 3  # create_user, create_access_key, put_user_policy


@dataclass
class Endpoint:
    url: str
    key: str
    secret: str

    def client(self, service: str = "s3", **creds: str):
        import boto3

        return boto3.client(service, endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id=creds.get("key", self.key),
                            aws_secret_access_key=creds.get("secret", self.secret))

    def bucket(self) -> str:
        """A new, empty bucket."""
        name = f"ckpt-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def moto_server() -> Iterator[Endpoint]:
    port = free_port()
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(SETUP_CALLS))
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)
        ep = Endpoint(f"http://127.0.0.1:{port}", "setup", "setup")
        iam = ep.client("iam")
        iam.create_user(UserName="ckptrun")
        key = iam.create_access_key(UserName="ckptrun")["AccessKey"]
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName="ckptrun", PolicyName="all", PolicyDocument=json.dumps(policy))
        yield Endpoint(ep.url, key["AccessKeyId"], key["SecretAccessKey"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
