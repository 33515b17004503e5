"""Two machines, one cache: machine A builds and publishes, machine B serves without packing anything.

Each "machine" is a directory of its own (its cache directory, its digest records, its home) and
machine B loads a copy of the checkpoint at another path, with other mtimes. The store is a
directory here; give an ``s3://bucket/prefix`` URL instead (with the usual ``AWS_*`` variables) to
use a bucket::

    python examples/fleet.py [STORE_URL]

Needs the ``models``, ``serve`` and ``fleet`` extras (``bash scripts/setup.sh`` installs them).
What each step checks and every miss reason: docs/FLEET.md.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def packcache(*args: str, env: dict[str, str]) -> dict:
    """Run ``packcache ARGS --json`` and return what it printed; stop with its message if it failed."""
    done = subprocess.run([sys.executable, "-m", "packcache", *args, "--json"], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"packcache {args[0]} failed: {done.stderr.strip()}")
    return json.loads(done.stdout)


def machine(root: Path) -> dict[str, str]:
    root.mkdir(parents=True)
    return {**os.environ, "HOME": str(root), "XDG_CACHE_HOME": str(root / "xdg"),
            "PACKCACHE_DIGEST_DIR": str(root / "digests")}  # fmt: skip


def main() -> None:
    from packcache.models import minilm

    work = Path(tempfile.mkdtemp(prefix="packcache-fleet-"))
    store = sys.argv[1] if len(sys.argv) > 1 else str(work / "store")
    if "://" not in store:
        os.makedirs(store, exist_ok=True)
    checkpoint = minilm.default_model_path()

    # Machine A, a CI job: a signing key, the cache built, the file published.
    a = machine(work / "a")
    key = work / "a" / "ci.pem"
    made = packcache("keygen", str(key), env=a)
    built = packcache("build", str(checkpoint), "--loader", "minilm", "--scheme", "int8", "--cache-dir",
                      str(work / "a" / "cache"), env=a)  # fmt: skip
    published = packcache("publish", built["cache_file"], store, "--sign", str(key), "--model", str(checkpoint), env=a)
    print(
        f"A: built {Path(built['cache_file']).name} ({built['stats']['stored']} packs packed), published as "
        f"generation {published['generation']} to {store}, signed by key {made['key_id']}"
    )

    # Machine B: another directory, a copy of the checkpoint elsewhere, 2 workers fetching on their first miss.
    b = machine(work / "b")
    model = work / "b" / "models" / "minilm"
    shutil.copytree(checkpoint, model)
    later = time.time() + 3600
    for path in model.rglob("*"):
        os.utime(path, (later, later))
    server = subprocess.Popen(
        [sys.executable, "-m", "packcache", "serve", "--workers", "2", "--port", "0", "--model", str(model),
         "--scheme", "int8", "--cache-dir", str(work / "b" / "cache"), "--remote", store,
         "--trusted-key", str(work / "a" / "ci.pub.pem")],
        env=b, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        port = None
        assert server.stdout is not None
        for line in server.stdout:
            if "Listening at: http://" in line:
                port = int(line.rsplit(":", 1)[1].split()[0].strip(")"))
                break
        if port is None:
            sys.exit("the server did not start")
        request = urllib.request.Request(f"http://127.0.0.1:{port}/embed", data=b'{"texts": ["hello fleet"]}')
        for _ in range(100):
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    vector = json.loads(response.read())["embeddings"][0]
                break
            except OSError:
                time.sleep(0.2)
        for _ in range(300):  # until both workers have loaded (each reports its state once its model is in)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
                metrics = response.read().decode()
            if sum(line.startswith("packcache_state{") and line.endswith(" 1.0") for line in metrics.splitlines()) == 2:
                break
            time.sleep(0.2)
        figures = [line for line in metrics.splitlines()
                   if line.startswith(("packcache_remote_hits", "packcache_packs{", "packcache_state{"))
                   and not line.endswith(" 0.0")]  # fmt: skip
        print(f"B: served an embedding of {len(vector)} floats; per worker:")
        for line in figures:
            print("   ", line)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
