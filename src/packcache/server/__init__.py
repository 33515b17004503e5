"""``packcache serve``: an embedding service of several worker processes on one shared cache file.

gunicorn forks the workers (``preload_app`` off); each loads all-MiniLM-L6-v2
through the same cache file after the fork, so N workers map one copy of the packed weights
(clean, shared, file-backed pages) and a cold start builds the file once. ``/metrics`` shows
every worker's cache state, heap bytes per reason, mapped bytes and errno, labelled by pid,
through prometheus_client's multiprocess mode. See ``docs/DEPLOY.md``.

Modules: :mod:`.master` (gunicorn settings and hooks, :func:`serve`), :mod:`.worker` (the
gunicorn worker: an event loop that reads whole requests, with client deadlines, before the
application runs; :mod:`._http1` reads a request, :mod:`._lanes` and :mod:`._calls` run the application),
:mod:`.wsgiapp` (what both WSGI applications share), :mod:`.app` (the embedding application and its request
checks), :mod:`.completions` (the generation application), :mod:`.modelfiles` (what the master reads of a
model's files), :mod:`.engines` (what a worker loads), :mod:`.llm` and :mod:`.sampling` (the generation
engine and a request's side of it), :mod:`.metrics` (prometheus_client). ``import packcache.server`` imports
neither gunicorn nor prometheus_client nor torch: :func:`serve` does, in the process it turns into the master.

Needs the ``serve`` extra (``pip install 'packcache[serve]'``: gunicorn, prometheus-client)
and the model extras.
"""

from __future__ import annotations

from .app import Batching
from .engines import ENGINES, EngineSpec, worker_threads
from .master import ServeOptions, serve
from .wsgiapp import Limits

__all__ = ["ENGINES", "Batching", "EngineSpec", "Limits", "ServeOptions", "serve", "worker_threads"]
