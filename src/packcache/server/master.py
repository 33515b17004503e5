"""The gunicorn master of ``packcache serve``: settings, hooks, and the metrics directory.

gunicorn (pre-fork, ``preload_app`` off) forks the workers; each loads
its own model after the fork (:func:`~packcache.server.engines.load_engine`), which is what
makes one worker build a cold cache under the build lock while the others wait and map it.
The master only imports the engine's modules before forking (no model, no thread). The
workers are :class:`~packcache.server.worker.BufferingWorker`: an event loop reads each whole
request (within ``limits``' deadlines) before the application sees it, so a slow client never
holds a worker.

Hooks: ``child_exit`` marks the worker's pid dead for prometheus_client (its live gauges
go); ``when_ready`` prints ``packcache serve: listening on http://HOST:PORT`` on stdout
(``--port 0`` picks a free port, and this line says which); ``on_exit`` removes the
metrics directory if the master made it (:mod:`.metricsdir` checks and holds the directory).
gunicorn's control socket is off (its default path is shared by every gunicorn of the user).
SIGTERM stops gracefully (workers finish their request, up to ``graceful_timeout``), SIGHUP
replaces every worker (a rolling restart that reopens the cache file), TTIN/TTOU add or remove
a worker.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from .. import _defaults
from .app import Batching
from .completions import Generation
from .engines import EngineSpec, preimport, weights_source
from .filecheck import clear_checks
from .metricsdir import HeldDirectory, hold_metrics_dir
from .wsgiapp import Limits

__all__ = ["ServeOptions", "check_address", "exit_now", "ready_line", "serve"]


@dataclass(frozen=True)
class ServeOptions:
    """How to run the server (``packcache serve``'s options).

    Attributes:
        engine: what each worker loads (:class:`~packcache.server.engines.EngineSpec`).
        workers: worker processes.
        host, port: where to listen (``port=0``: a free port, printed when ready).
        timeout: seconds a worker's application may spend on one request (or the worker on
            loading its model) before the master kills and replaces it. Time a client takes to
            send or receive never counts: that is ``limits``' deadlines. Must exceed the cache's lock timeout
            (30 s): a worker waiting for another's build must not be killed for it.
        graceful_timeout: seconds workers get to finish their request after SIGTERM.
        limits: what one request may ask for, and the client deadlines (header, body, send).
        batching: how each worker merges concurrent requests into one forward (embedding models).
        generation: what one request may ask a causal LM for (:class:`~packcache.server.completions.Generation`).
        metrics_dir: prometheus_client's directory; ``None``: ``$PROMETHEUS_MULTIPROC_DIR``
            if set (its ``*.db`` files are removed at start, as the client library requires
            between runs; refused unless this user's or root's and writable by no one else, or
            when reached through a symlink another user can change), else a fresh private
            ``0700`` directory removed at exit. Either is checked once and held open
            (:mod:`.metricsdir`): prometheus_client reaches it as ``/proc/self/fd/N``.
        log_level: gunicorn's log level.
    """

    engine: EngineSpec = field(default_factory=EngineSpec)
    workers: int = 1
    host: str = _defaults.SERVE_HOST
    port: int = _defaults.SERVE_PORT
    timeout: float = _defaults.SERVE_TIMEOUT
    graceful_timeout: float = _defaults.GRACEFUL_TIMEOUT
    limits: Limits = field(default_factory=Limits)
    batching: Batching = field(default_factory=Batching)
    generation: Generation = field(default_factory=Generation)
    metrics_dir: str | None = None
    log_level: str = _defaults.SERVE_LOG_LEVEL


def exit_now(code: object) -> NoReturn:
    """End this process with ``code`` (``sys.exit``'s), skipping the interpreter's teardown.

    After a model is loaded, tearing the interpreter down (torch's modules, the model's objects)
    took 0.5 to 0.9 s of CPU in each worker and 0.5 s in the master, all of it after the worker had
    stopped serving: on a shared 2-core machine an idle server took 6-7 s to stop. The exit
    handlers still run (logging's flush among them) and the standard streams are flushed.
    """
    # pinned by tests/test_server_master.py::test_an_idle_server_stops_within_2_s_of_sigterm
    status = 0 if code is None else code if isinstance(code, int) else 1
    if not isinstance(code, int) and code is not None:
        print(code, file=sys.stderr)
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status & 0xFF)


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


#: What each errno of a bind or listen means for ``packcache serve``'s address.
_ADDRESS_HINTS = {
    errno.EADDRINUSE: "another process listens there: stop it, or choose another --port (0 picks a free one)",
    errno.EACCES: "a port under 1024 needs root or CAP_NET_BIND_SERVICE: choose another --port",
    errno.EADDRNOTAVAIL: "the host is not an address of this machine: choose another --host",
}


def check_address(host: str, port: int) -> None:
    """Refuse an address the server could not listen on, before anything starts: bind and listen on it as gunicorn
    will (``SO_REUSEADDR``: a port whose last connections are in TIME_WAIT is free), then let it go.

    gunicorn itself tries a busy address five times, a second apart, and its master then exits with a line that
    names neither the address nor the errno. An address taken between this check and gunicorn's bind still goes
    that way.

    Raises:
        ValueError: the address and the errno (``cannot listen on 127.0.0.1:8000: EADDRINUSE (...)``), or a host
            that does not resolve.
    """
    # pinned by tests/test_server_master.py::test_a_busy_port_is_refused_at_once_naming_the_address_and_the_errno
    address = _bind(host, port)
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        with socket.socket(socket.AF_INET6 if ":" in name else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((name, port))
            probe.listen()
    except socket.gaierror as exc:
        raise ValueError(f"cannot listen on {address}: the host does not resolve ({exc.strerror})") from None
    except OSError as exc:
        code = errno.errorcode.get(exc.errno or 0, f"errno {exc.errno}")
        hint = _ADDRESS_HINTS.get(exc.errno or 0)
        raise ValueError(f"cannot listen on {address}: {code} ({exc.strerror}){f'; {hint}' if hint else ''}") from None


def serve(options: ServeOptions) -> int:
    """Run the server in this process (it becomes the gunicorn master) until it is stopped.

    Returns 0 after a clean stop (SIGTERM, SIGINT), 1 when it could not start or a worker
    could not load its model (a missing model package, a bad checkpoint; never a cache
    problem, which only shows in the metrics).

    Raises:
        ValueError: an address the server cannot listen on (:func:`check_address`); a metrics directory that cannot
            be written or trusted (:func:`.metricsdir.hold_metrics_dir`).
        RuntimeError: prometheus_client was imported in this process before
            ``PROMETHEUS_MULTIPROC_DIR`` was set (its values would stay in each worker's memory).
    """
    check_address(options.host, options.port)
    if "prometheus_client" in sys.modules and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        raise RuntimeError(
            "prometheus_client was imported before packcache serve set PROMETHEUS_MULTIPROC_DIR: "
            "its multiprocess mode can no longer be turned on in this process"
        )
    given_env = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    held = hold_metrics_dir(options.metrics_dir or given_env)
    if held.private is None:
        held.wipe()
    clear_checks(held.fd)  # a new server checks its file again (an operator's directory keeps the last one's)
    # Before prometheus_client is imported, before any fork: every worker inherits the descriptor.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = held.path
    threads = str(options.engine.torch_threads)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
        os.environ[name] = threads  # OpenMP, MKL and the tokenizer's pool, as torch's own (set per worker)
    master = os.getpid()
    try:
        from . import metrics  # imports prometheus_client, now in multiprocess mode

        preimport(options.engine.engine, options.engine.loader)
        application = _application(options, metrics.mark_process_dead, held, given_env)
        application.run()
    except SystemExit as exc:
        if os.getpid() != master:
            exit_now(exc.code)  # a worker leaving gunicorn's loop, with its own code
        return 0 if exc.code in (None, 0) else 1
    finally:
        if os.getpid() == master:
            held.remove()
    return 0


def _application(
    options: ServeOptions, mark_dead: Callable[[int], None], held: HeldDirectory, given_env: str | None = None
) -> Any:
    """The gunicorn application. ``given_env``: ``$PROMETHEUS_MULTIPROC_DIR`` as the operator set it."""
    from gunicorn.app.base import BaseApplication  # type: ignore[import-untyped]

    from .worker import worker_class

    def child_exit(server: Any, worker: Any) -> None:
        # a dead worker's gauges would stay in every scrape; pinned by
        #   tests/test_server_master.py::test_a_worker_killed_mid_request_is_replaced_and_maps_again
        mark_dead(worker.pid)

    def when_ready(server: Any) -> None:
        for listener in server.LISTENERS:
            host, port = listener.sock.getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            print(f"packcache serve: listening on http://{shown}:{port}", flush=True)

    def on_exit(server: Any) -> None:
        held.remove()

    settings: dict[str, Any] = {
        "bind": [_bind(options.host, options.port)],
        "workers": options.workers,
        "worker_class": worker_class(options.limits, options.batching),
        "preload_app": False,
        "timeout": int(max(1, options.timeout)),
        "graceful_timeout": int(max(1, options.graceful_timeout)),
        "control_socket_disable": True,
        "proc_name": "packcache-serve",
        "loglevel": options.log_level,
        "errorlog": "-",
        "child_exit": child_exit,
        "when_ready": when_ready,
        "on_exit": on_exit,
    }

    class Application(BaseApplication):  # type: ignore[misc]
        def load_config(self) -> None:
            for key, value in settings.items():
                self.cfg.set(key, value)

        def load(self) -> Any:
            return make_app(options, held.fd)

    application = Application(prog="packcache serve")
    # gunicorn re-executes itself (USR2) with the environment it saw at start, which holds this
    # process's /proc/self/fd/N: a descriptor the new master does not have. Give it the operator's.
    # pinned by tests/test_server_metricsdir.py::
    #   test_a_gunicorn_re_exec_gets_the_operators_metrics_dir_not_this_processs_descriptor
    if given_env is None:
        application.cfg.env_orig.pop("PROMETHEUS_MULTIPROC_DIR", None)
    else:
        application.cfg.env_orig["PROMETHEUS_MULTIPROC_DIR"] = given_env
    return application


def make_app(options: ServeOptions, metrics_dir_fd: int | None = None) -> Any:
    """Load the model in this worker and return its WSGI application (gunicorn calls it after the fork); log the
    worker's ready line (:func:`ready_line`) at INFO on gunicorn's error log. Then, in the background, every pack of
    the cache file it maps is checked once per server (:func:`~packcache.server.filecheck.start_check`: one worker's
    child process at nice 19; ``metrics_dir_fd``, the server's held metrics directory, keeps the claim and the
    result the workers share; ``None``: no check)."""
    import logging

    from ..memory import release_free_heap
    from . import metrics
    from .app import EmbeddingApp
    from .completions import CompletionApp
    from .engines import load_engine
    from .filecheck import start_check

    engine: Any
    if options.engine.loader == "causal":  # a causal LM: the generation engine (its module imports engines')
        from .llm import load_llm
        from .modelfiles import model_id_of

        engine = load_llm(options.engine)
        engine.model_id = options.engine.model_id or model_id_of(options.engine.model)
    else:
        engine = load_engine(options.engine)
    # glibc keeps what a load freed (a checkpoint's fp32 tensors, packing temporaries) for reuse, as dirty heap the
    # worker would hold for its life: 13 MB for a heap int8 MiniLM, 2.5 MB for a mapped one. Handing it back costs about
    # a millisecond, once per worker. Pinned by
    # tests/test_server_engines.py::test_per_worker_pss_of_the_mapping_is_a_quarter_of_the_file_against_heap_workers
    release_free_heap()
    # gunicorn's own logger: the line goes where the server's other lines go (--log-level), never to a packcache
    # logger (a clean load logs nothing there).
    # pinned by tests/test_server_models.py::test_each_worker_logs_one_ready_line_naming_where_its_weights_came_from
    logging.getLogger("gunicorn.error").info("%s", ready_line(engine, os.getpid()))
    # After the load, never inside it: a warm load reads no pack data (docs/RELIABILITY.md "Performance guard"), and
    # a file mapped for weeks is still checked once. Only a file something is mapped from.
    # pinned by tests/test_server_filecheck.py::test_a_server_of_a_damaged_file_says_so_in_healthz_metrics_and_its_log
    stats = engine.stats()
    mapped = engine.cache_file if stats is not None and stats.mapped_bytes > 0 else ""
    engine.file_check = start_check(mapped, metrics_dir_fd, log_level=options.log_level)
    worker = metrics.WorkerMetrics(
        engine.name, engine.scheme, engine.kernel_path, engine.cache_file, engine.load_seconds,
        file_check=engine.file_check.current,
    )  # fmt: skip
    if getattr(engine, "kind", "embed") == "generate":
        return CompletionApp(engine, worker, metrics.exposition, options.limits, options.generation)
    return EmbeddingApp(engine, worker, metrics.exposition, options.limits, options.batching)


def ready_line(engine: Any, pid: int) -> str:
    """The line a worker logs once its model is loaded: its pid, the model, the cache's state, the load's seconds
    and where the weights came from (:func:`~packcache.server.engines.weights_source`: ``mapped``, ``stored``,
    ``remote``, or ``heap`` with the reason).

    >>> from packcache.server.engines import Engine
    >>> ready_line(Engine(), 7).startswith("packcache serve: worker 7 ready: model , engine engine, cache none, ")
    True
    """
    stats = engine.stats()
    source, why = weights_source(stats)
    state = stats.state if stats is not None else "none"
    where = f" {engine.cache_file}" if engine.cache_file else ""
    scheme = f" {engine.scheme}" if engine.scheme else ""
    return (
        f"packcache serve: worker {pid} ready: model {engine.model_id}, engine {engine.name}{scheme}, "
        f"cache {state}{where}, source {source}{f' ({why})' if why else ''}, loaded in {engine.load_seconds:.2f} s"
    )
