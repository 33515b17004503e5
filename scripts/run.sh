#!/usr/bin/env bash
# The main job. Until the CLI lands this is the core quickstart example.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/quickstart.py "$@"
