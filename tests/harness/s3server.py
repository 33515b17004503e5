"""Real S3-protocol servers on 127.0.0.1 for the fleet tests: moto's standalone server, SeaweedFS's ``weed mini``.

Each is a context manager yielding an :class:`S3Server`: a bucket URL and the ``AWS_*`` environment
that reaches it (dummy keys, ``us-east-1``, ``AWS_ENDPOINT_URL=http://127.0.0.1:<port>``). The server
is a real process listening only on 127.0.0.1; it is killed (and waited for) on exit. Tests use the
fixtures ``moto_s3`` (one server per run) and ``moto_env`` (its variables set) of ``tests/conftest.py``;
other code ``with moto_server() as server:``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

__all__ = ["S3Server", "free_port", "moto_server", "s3_env", "weed_server"]

BIN = Path(sys.executable).parent
#: Credentials the servers accept (moto checks none; weed mini runs without IAM when none are configured).
ACCESS_KEY = "packcache-test"
SECRET_KEY = "packcache-test-secret"


@dataclasses.dataclass
class S3Server:
    """A running server: ``url`` (``s3://<bucket>``), ``endpoint``, ``env`` (what a client needs), the process."""

    endpoint: str
    bucket: str
    env: dict[str, str]
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}"

    def kill(self) -> None:
        """SIGKILL the server (a crash, not a shutdown) and reap it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    @contextlib.contextmanager
    def environment(self) -> Iterator[None]:
        """``os.environ`` with :attr:`env` set, restored after."""
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _xdist_worker() -> tuple[int, int]:
    """(this pytest-xdist worker's index, the number of workers), or (0, 1) outside xdist."""
    name, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if name.startswith("gw") and name[2:].isdigit() and count.isdigit() and int(name[2:]) < int(count):
        return int(name[2:]), int(count)
    return 0, 1


def free_port(avoid: Collection[int] = ()) -> int:
    """A TCP port free on 127.0.0.1 right now, in 20000-22767, and not in ``avoid`` (the ports already drawn for
    one server: each is free until the server binds it, so drawing again could return one). A server is started
    on it some seconds later, so
    nothing else may take it meanwhile: servers listen on ``port + 10000`` too (weed's gRPC ports derived from the
    HTTP ones), and both stay below the kernel's ephemeral ports (32768 up), which ``--port 0`` servers and every
    client's own end are given; and under pytest-xdist each worker draws from its own residue class
    (``port % workers``), so two workers never pick the same port."""
    worker, workers = _xdist_worker()
    for _ in range(200):
        port = random.randrange(20000 + worker, 22768, workers)
        if port in avoid:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on 127.0.0.1 in 20000-22767 (pytest-xdist worker {worker} of {workers})")


def s3_env(endpoint: str) -> dict[str, str]:
    """The standard AWS variables for an S3-compatible server at ``endpoint`` (``http://…``)."""
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ALLOW_HTTP": "true",
    }


def _wait_until(check: Any, deadline: float, process: subprocess.Popen[bytes], log: Path, what: str) -> None:
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}: {log.read_text()[-2000:]}")
        with contextlib.suppress(OSError):
            if check():
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not answer in time: {log.read_text()[-2000:]}")


def _http(method: str, url: str, timeout: float = 2.0) -> int:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _start(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env
        )


def _stop(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(10)


@contextlib.contextmanager
def moto_server(bucket: str = "packcache-test", *, startup: float = 30.0) -> Iterator[S3Server]:
    """moto's standalone S3 server on 127.0.0.1 with ``bucket`` created (plain HTTP ``PUT /<bucket>``)."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="packcache-moto-")) / "moto.log"
    process = _start([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], log)
    try:
        deadline = time.monotonic() + startup
        _wait_until(lambda: _http("GET", f"{endpoint}/moto-api/") < 500, deadline, process, log, "moto_server")
        # A fresh moto answers its first PUT slowly on a loaded machine (2 s was not always enough in the
        # default suite): the setup's own bound, not a deadline packcache is held to.
        status = _http("PUT", f"{endpoint}/{bucket}", timeout=30.0)
        assert status == 200, f"creating bucket {bucket} on moto: HTTP {status}"
        yield S3Server(endpoint, bucket, s3_env(endpoint), process, log)
    finally:
        _stop(process)
        shutil.rmtree(log.parent, ignore_errors=True)


@contextlib.contextmanager
def weed_server(bucket: str = "packcache-test", *, startup: float = 60.0) -> Iterator[S3Server]:
    """SeaweedFS ``weed mini`` with every listener on 127.0.0.1 and ``bucket`` created, data in a temp dir."""
    data = Path(tempfile.mkdtemp(prefix="packcache-weed-"))
    log = data / "weed.log"
    ports: dict[str, int] = {}
    for name in _WEED_PORTS:  # ten listeners: drawn independently, two would share a port in ~5 % of starts
        ports[name] = free_port(avoid=ports.values())
    argv = [str(BIN / "weed"), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
    argv += [f"-{name}={port}" for name, port in ports.items()]
    argv += [
        f"-bucket={bucket}",
        "-master.telemetry=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
    ]
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    env = dict(os.environ, **s3_env(endpoint), HOME=str(data))
    process = _start(argv, log, env)
    try:
        deadline = time.monotonic() + startup
        # With AWS_ACCESS_KEY_ID set, weed mini creates that identity and checks every request: ask signed.
        client = _boto3_client(endpoint)
        _wait_until(lambda: _bucket_ready(client, bucket), deadline, process, log, "weed mini")
        yield S3Server(endpoint, bucket, s3_env(endpoint), process, log)
    finally:
        _stop(process)
        shutil.rmtree(data, ignore_errors=True)


def _boto3_client(endpoint: str) -> Any:
    import boto3  # type: ignore[import-untyped]  # installed with moto[server]; only the weed harness needs it

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
    )


def _bucket_ready(client: Any, bucket: str) -> bool:
    try:
        client.head_bucket(Bucket=bucket)
    except Exception:
        return False
    return True


_WEED_PORTS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)
