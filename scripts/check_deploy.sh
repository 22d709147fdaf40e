#!/usr/bin/env bash
# Static checks of the deployment files, with no Docker engine and no cluster:
#   * docker-compose.yml alone and with each override validates, with and
#     without the gateway profile (one cluster, two with compose.replicas.yml,
#     a prefill and a decode cluster with compose.pd.yml);
#   * the Helm chart lints and renders with default, GPU and all-options values,
#     with the SMG gateway in front of two replicas, and in PD mode;
#   * every rendered manifest validates against the Kubernetes OpenAPI schemas
#     (kubernetes-validate, strict: unknown fields fail) of the oldest and the
#     newest Kubernetes the chart supports.
# Tools come from scripts/install_deploy_tools.sh. Takes a few seconds.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

helm=${HELM:-}
if [ -z "$helm" ]; then
  if [ -x .tools/bin/helm ]; then helm=.tools/bin/helm; else helm=$(command -v helm || true); fi
fi
if [ -z "$helm" ] || ! command -v docker-compose >/dev/null 2>&1; then
  echo "check_deploy: helm or docker-compose missing; run scripts/install_deploy_tools.sh" >&2
  exit 1
fi
python=${PYTHON:-.venv/bin/python}
# The oldest version with the apps.kubernetes.io/pod-index label on by
# default that the bundled schemas cover, and the newest.
k8s_versions=${K8S_VERSIONS:-"1.29.0 1.37.0"}

echo "== docker-compose config"
compose() { docker-compose "$@"; }
compose -f docker-compose.yml config -q
compose -f docker-compose.yml --profile grafana config -q
compose -f docker-compose.yml -f deploy/compose.gpu.yml config -q
compose -f docker-compose.yml --profile gateway config -q
compose -f docker-compose.yml -f deploy/compose.replicas.yml --profile gateway config -q
compose -f docker-compose.yml -f deploy/compose.pd.yml --profile gateway config -q
compose -f docker-compose.yml -f deploy/compose.tls.yml --profile gateway config -q
model_dir=$(mktemp -d)
trap 'rm -rf "$model_dir" "${render_dir:-}"' EXIT
KVLOOM_HF_MODEL_DIR=$model_dir compose -f docker-compose.yml -f deploy/compose.hf-model.yml config -q
echo "compose files OK"

if command -v promtool >/dev/null 2>&1; then
  echo "== promtool (Prometheus config and alert rules)"
  # prometheus.yml names its rules by their path inside the container; check a
  # copy that points at the file here.
  prom_dir=$(mktemp -d)
  sed "s|/etc/prometheus/alerts.yml|$root/deploy/prometheus/alerts.yml|" \
    deploy/prometheus/prometheus.yml > "$prom_dir/prometheus.yml"
  promtool check config --syntax-only "$prom_dir/prometheus.yml" >/dev/null
  promtool check rules deploy/prometheus/alerts.yml >/dev/null
  rm -rf "$prom_dir"
  echo "prometheus files OK"
else
  echo "== promtool not installed; Prometheus files not checked (scripts/install_test_tools.sh installs it)"
fi

echo "== helm lint"
chart=helm/kvloom
"$helm" lint --strict --quiet "$chart"
"$helm" lint --strict --quiet "$chart" -f "$chart/values-gpu.yaml"
"$helm" lint --strict --quiet "$chart" --set gateway.enabled=true --set replicas=2
"$helm" lint --strict --quiet "$chart" --set gateway.enabled=true --set pd.enabled=true

echo "== helm template + kubernetes-validate ($k8s_versions)"
render_dir=$(mktemp -d)
"$helm" template kvloom "$chart" --namespace kvloom > "$render_dir/default.yaml"
"$helm" template kvloom "$chart" --namespace kvloom -f "$chart/values-gpu.yaml" > "$render_dir/gpu.yaml"
# Every optional branch at once: monitoring CRs, a created model PVC with the
# default model converted onto it, hostname-derived ranks, extra args and env.
"$helm" template kvloom "$chart" --namespace kvloom \
  --set monitoring.serviceMonitor.enabled=true \
  --set monitoring.prometheusRule.enabled=true \
  --set model.volume.enabled=true \
  --set model.convertDefaultModel.enabled=true \
  --set workers.rankFrom=hostname \
  --set workers.readinessProbe.enabled=false \
  --set auth.token=fixed-token \
  --set 'controlplane.extraArgs={--no-enable-prefix-caching}' \
  --set-string 'controlplane.extraEnv[0].name=EXTRA,controlplane.extraEnv[0].value=1' \
  --set controlplane.service.type=LoadBalancer > "$render_dir/all.yaml"
# The SMG gateway in front of two whole clusters, its own options set too.
"$helm" template kvloom "$chart" --namespace kvloom \
  --set gateway.enabled=true \
  --set replicas=2 \
  --set gateway.policy=power_of_two \
  --set 'gateway.extraArgs={--tool-call-parser=json}' \
  --set gateway.service.type=LoadBalancer \
  --set-string 'networkPolicy.apiFrom[0].namespaceSelector.matchLabels.team=apps' \
  --set-string 'networkPolicy.gatewayFrom[0].namespaceSelector.matchLabels.team=apps' \
  --set monitoring.serviceMonitor.enabled=true > "$render_dir/gateway.yaml"
# Prefill/decode disaggregation: two prefill clusters and one decode cluster
# of its own TP behind the gateway in PD mode, network policies on.
"$helm" template kvloom "$chart" --namespace kvloom \
  --set gateway.enabled=true \
  --set pd.enabled=true \
  --set pd.prefill.replicas=2 \
  --set pd.decode.tensorParallelSize=2 \
  --set pd.kvConnectorExtraConfig.kv_lease_duration=60 \
  --set-string 'networkPolicy.apiFrom[0].namespaceSelector.matchLabels.team=apps' \
  --set monitoring.serviceMonitor.enabled=true > "$render_dir/pd.yaml"
"$python" - "$k8s_versions" "$render_dir"/*.yaml <<'PY'
import sys

import kubernetes_validate
import yaml

versions = sys.argv[1].split()
# Prometheus Operator CRs have no schema in the Kubernetes API; their shape is
# covered by tests/deploy/test_static.py instead.
crd_kinds = {"ServiceMonitor", "PrometheusRule"}
failures = 0
for path in sys.argv[2:]:
    docs = [d for d in yaml.safe_load_all(open(path)) if d]
    kinds = []
    for doc in docs:
        kinds.append(doc["kind"])
        if doc["kind"] in crd_kinds:
            continue
        for version in versions:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                failures += 1
                where = f"{doc['kind']}/{doc['metadata']['name']}"
                print(f"{path}: {where} (k8s {version}): {exc.message} at {list(exc.path)}")
    print(f"{path.rsplit('/', 1)[-1]}: {len(docs)} objects ({', '.join(sorted(kinds))})")
sys.exit(1 if failures else 0)
PY
echo "rendered manifests OK"

if command -v promtool >/dev/null 2>&1; then
  # The PrometheusRule's spec is a Prometheus rules file.
  "$python" -c 'import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d["kind"] == "PrometheusRule"]
yaml.safe_dump(docs[0]["spec"], open(sys.argv[2], "w"))' "$render_dir/all.yaml" "$render_dir/rules.yml"
  promtool check rules "$render_dir/rules.yml" >/dev/null
  echo "PrometheusRule OK"
fi
