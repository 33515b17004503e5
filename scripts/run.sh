#!/usr/bin/env bash
# The main job: `packcache run` on the bundled all-MiniLM-L6-v2 (scheme auto: int8 on AVX2/AVX512 CPUs).
# Run it twice: the first launch packs and stores, the second maps.
# Extra arguments pass through, e.g. `bash scripts/run.sh --scheme int4 --json`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/packcache run "$@"
