"""The test harness: what the tests, the stress harnesses and their child processes share.

``tests/`` is on ``sys.path`` under pytest (there is no ``tests/__init__.py``), in
every child process (``CHILD_PRELUDE``) and in every ``stress/*.py`` command
line, which are thin CLIs over the modules here:

* ``packs``: deterministic packs (``packed``, ``Packer``, ``assert_same``), ``build``,
  ``build_keyed``/``load_all``/``KEY`` and ``without_build_compaction``;
* ``files``: a file's state, garbage, flipped bits, a planted socket, what a file commits;
* ``mounts``: a tiny tmpfs, a read-only bind mount, ``require_root``;
* ``checkpoints``: tiny random BERT checkpoints the loaders load (``tiny_bert``);
* ``serve``: ``packcache serve`` in a child process, its HTTP API and scrapes (``server``);
* ``child``: the child prelude, ``run_child``, two appenders on one file;
* ``driver``, ``faults``, ``entry_faults``: the fault matrix (``stress/faults.py``);
* ``crash``, ``stampede``, ``fuzz``, ``interrupts``, ``stability``: the other stress harnesses.

This module re-exports the small common helpers; the harnesses are imported as
``from harness import faults`` or ``from harness.faults import ...``.
"""

from __future__ import annotations

from harness.child import (
    CHILD_PRELUDE,
    TESTS_DIR,
    child_argv,
    error_records,
    last_json,
    run_child,
    two_appenders,
)
from harness.files import committed, file_state, flip_bit, garbage, plant_socket, save_safetensors, snapshot
from harness.mounts import ROOT_ONLY, fill, read_only_bind, require_root, tmpfs
from harness.packs import (
    KEY,
    KIB,
    MIB,
    Packer,
    Request,
    Spec,
    assert_same,
    build,
    build_generations,
    build_keyed,
    load_all,
    packed,
    same_pack,
    stuck_in_pack,
    without_build_compaction,
)

__all__ = [
    "CHILD_PRELUDE",
    "KEY",
    "KIB",
    "MIB",
    "ROOT_ONLY",
    "TESTS_DIR",
    "Packer",
    "Request",
    "Spec",
    "assert_same",
    "build",
    "build_generations",
    "build_keyed",
    "child_argv",
    "committed",
    "error_records",
    "fill",
    "file_state",
    "flip_bit",
    "garbage",
    "last_json",
    "load_all",
    "packed",
    "read_only_bind",
    "require_root",
    "run_child",
    "same_pack",
    "plant_socket",
    "save_safetensors",
    "snapshot",
    "stuck_in_pack",
    "tmpfs",
    "two_appenders",
    "without_build_compaction",
]
