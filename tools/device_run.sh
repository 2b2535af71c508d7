#!/usr/bin/env bash
# The prepared GPU run on a machine with the image's own python3 (torch, transformers, peft...)
# and no network: install the kit's wheels (`make device-kit`) into a target directory with
# --no-index --no-deps, then run tools/device_run.py (its JSON lands in $OUT, or --out).
#   tools/device_run.sh [device_run.py args...]
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${KIT:-.device-kit}
SITE=${SITE:-/tmp/relayrl-site}
PY=${PY:-python3}
if ls "$KIT"/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$KIT"/*.whl
fi
export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec "$PY" tools/device_run.py "$@"
