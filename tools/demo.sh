#!/usr/bin/env bash
# The main job: installs/builds what is missing, then runs `layerstream demo`.
# Extra arguments go to the demo (e.g. --steps 20).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash tools/setup.sh >&2
BUILD_DIR=${LS_BUILD_DIR:-build}
exec "$BUILD_DIR/layerstream" demo "$@"
