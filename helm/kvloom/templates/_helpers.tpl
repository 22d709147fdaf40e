{{/* Names. fullname is the release-scoped prefix of every object. */}}
{{- define "kvloom.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvloom.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "kvloom.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "kvloom.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/*
Names of one replica (one whole cluster: a controlplane and its ranks), given
(list $ replica). Replica 0 keeps the names of a single-cluster release
(<fullname>); replica i > 0 is <fullname>-<i>.
*/}}
{{- define "kvloom.replicaName" -}}
{{- $ctx := index . 0 }}
{{- $replica := int (index . 1) }}
{{- if eq $replica 0 }}
{{- include "kvloom.fullname" $ctx }}
{{- else }}
{{- printf "%s-%d" (include "kvloom.fullname" $ctx | trunc 56 | trimSuffix "-") $replica }}
{{- end }}
{{- end }}

{{/*
Every whole cluster of the release, as a JSON list (`include ... | fromJsonArray`),
each {"name", "label", "role", "tp"}: its object-name prefix, its
kvloom.io/replica label, its PD role ("" without pd.enabled) and its TP.
Without pd.enabled: `replicas` alike clusters, named by kvloom.replicaName.
With it: pd.prefill.replicas KV producers, then pd.decode.replicas KV
consumers, <fullname>-prefill-<i> and <fullname>-decode-<i> (fullname cut to
40 characters, so that even the StatefulSet's 52 keep the index).
*/}}
{{- define "kvloom.clusters" -}}
{{- $clusters := list }}
{{- if .Values.pd.enabled }}
{{- $base := include "kvloom.fullname" . | trunc 40 | trimSuffix "-" }}
{{- range $role := list "prefill" "decode" }}
{{- $r := index $.Values.pd $role }}
{{- $tp := int (default $.Values.parallel.tensorParallelSize $r.tensorParallelSize) }}
{{- range $i := until (int $r.replicas) }}
{{- $clusters = append $clusters (dict "name" (printf "%s-%s-%d" $base $role $i) "label" (printf "%s-%d" $role $i) "role" $role "tp" $tp) }}
{{- end }}
{{- end }}
{{- else }}
{{- range $i := until (int .Values.replicas) }}
{{- $clusters = append $clusters (dict "name" (include "kvloom.replicaName" (list $ $i)) "label" (toString $i) "role" "" "tp" (int $.Values.parallel.tensorParallelSize)) }}
{{- end }}
{{- end }}
{{- toJson $clusters }}
{{- end }}

{{/* A cluster's controlplane Service: its workers and the gateway dial this name. */}}
{{- define "kvloom.controlplaneService" -}}
{{- .name }}
{{- end }}

{{/* A cluster's workers' headless Service; pod DNS is <pod>.<this>.<ns>.svc.<domain>. */}}
{{- define "kvloom.workersService" -}}
{{- printf "%s-workers" .name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvloom.workersStatefulSet" -}}
{{- printf "%s-workerd" .name | trunc 52 | trimSuffix "-" }}
{{- end }}

{{/* The labels that tell the clusters' pods apart (in every cluster's
selectors): kvloom.io/replica, and kvloom.io/pd-role under pd.enabled. */}}
{{- define "kvloom.clusterLabels" -}}
kvloom.io/replica: {{ .label | quote }}
{{- with .role }}
kvloom.io/pd-role: {{ . }}
{{- end }}
{{- end }}

{{/* A cluster's ranks, given (list $ cluster): its TP x the pipeline stages. */}}
{{- define "kvloom.worldSize" -}}
{{- $ctx := index . 0 }}
{{- mul (int (index . 1).tp) (int $ctx.Values.parallel.pipelineParallelSize) }}
{{- end }}

{{/* A cluster's controlplane Service as other pods resolve it, from any namespace. */}}
{{- define "kvloom.controlplaneServiceHost" -}}
{{- $ctx := index . 0 }}
{{- printf "%s.%s.svc.%s" (include "kvloom.controlplaneService" (index . 1)) $ctx.Release.Namespace $ctx.Values.clusterDomain }}
{{- end }}

{{/*
vLLM's --kv-transfer-config of a cluster, given (list $ cluster): the
connector, kv_producer for prefill and kv_consumer for decode, and
pd.kvConnectorExtraConfig as kv_connector_extra_config. A producer's
side_channel_host is its controlplane Service's DNS name: the consumers dial
it for the KVTransfer service (the controlplane binds 0.0.0.0, and its
default behind a wildcard, loopback, reaches no other pod).
*/}}
{{- define "kvloom.kvTransferConfig" -}}
{{- $ctx := index . 0 }}
{{- $c := index . 1 }}
{{- $producer := eq $c.role "prefill" }}
{{- $config := dict "kv_connector" $ctx.Values.pd.kvConnector "kv_role" (ternary "kv_producer" "kv_consumer" $producer) }}
{{- $extra := deepCopy (default dict $ctx.Values.pd.kvConnectorExtraConfig) }}
{{- if $producer }}
{{- $_ := set $extra "side_channel_host" (include "kvloom.controlplaneServiceHost" (list $ctx $c)) }}
{{- end }}
{{- with $extra }}
{{- $_ := set $config "kv_connector_extra_config" . }}
{{- end }}
{{- toJson $config }}
{{- end }}

{{/*
The gateway's workers, one argument a line: every cluster's controlplane API
as --worker-urls, or under pd.enabled PD mode: each prefill cluster's as
--prefill URL none (no bootstrap port: that is SGLang's handshake; the
clusters negotiate theirs between themselves), each decode cluster's as --decode URL.
*/}}
{{- define "kvloom.gatewayWorkerArgs" -}}
{{- $clusters := include "kvloom.clusters" . | fromJsonArray }}
{{- if .Values.pd.enabled }}
- --pd-disaggregation
{{- range $c := $clusters }}
- --{{ $c.role }}
- {{ printf "grpc://%s:%v" (include "kvloom.controlplaneService" $c) $.Values.controlplane.ports.api | quote }}
{{- if eq $c.role "prefill" }}
- none
{{- end }}
{{- end }}
{{- else }}
- --worker-urls
{{- range $c := $clusters }}
- {{ printf "grpc://%s:%v" (include "kvloom.controlplaneService" $c) $.Values.controlplane.ports.api | quote }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvloom.gatewayImage" -}}
{{- $g := .Values.gateway.image }}
{{- if $g.repository }}
{{- printf "%s:%s" $g.repository (default .Chart.AppVersion $g.tag) }}
{{- else }}
{{- include "kvloom.image" . }}
{{- end }}
{{- end }}

{{- define "kvloom.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kvloom.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "kvloom.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvloom.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvloom.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "kvloom.authSecretName" -}}
{{- default (printf "%s-auth" (include "kvloom.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{- define "kvloom.modelClaimName" -}}
{{- default (printf "%s-model" (include "kvloom.fullname" .)) .Values.model.volume.existingClaim }}
{{- end }}

{{/*
Where the default model is converted to when an init container converts it:
on the model volume if there is one (converted once, shared by every pod),
else a per-pod emptyDir (each pod converts its own, to the same path).
Empty when nothing is converted (the image carries the model, or model.path
names a checkpoint).
*/}}
{{- define "kvloom.cacheDir" -}}
{{- if .Values.model.convertDefaultModel.enabled }}
{{- if .Values.model.volume.enabled }}
{{- printf "%s/kvloom-cache" (trimSuffix "/" .Values.model.volume.mountPath) }}
{{- else }}
{{- print "/var/cache/kvloom" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Env every kvloom container gets: the model cache. (The shared secret is
a mounted file, kvloom.secretMounts: never an env var or an argument.) */}}
{{- define "kvloom.commonEnv" -}}
{{- with include "kvloom.cacheDir" . }}
- name: KVLOOM_CACHE_DIR
  value: {{ . | quote }}
{{- end }}
{{- end }}

{{/* Where the mounted secrets are: the token file and the TLS directories. */}}
{{- define "kvloom.authTokenFile" -}}/etc/kvloom/auth/token{{- end }}
{{- define "kvloom.tlsDir" -}}/etc/kvloom/tls{{- end }}

{{/*
The volumes every kvloom pod mounts besides the model: the auth token, the
worker-plane TLS Secret of its component ("controlplane" or "workerd"), and
the writable emptyDirs a read-only root filesystem leaves (/tmp, ~/.cache).
*/}}
{{- define "kvloom.secretVolumes" -}}
{{- $ctx := index . 0 }}
{{- $component := index . 1 }}
{{- $tls := $ctx.Values.tls.worker }}
{{- $api := $ctx.Values.tls.api }}
- name: auth-token
  secret:
    secretName: {{ include "kvloom.authSecretName" $ctx }}
    defaultMode: 0440
    items:
      - key: {{ $ctx.Values.auth.existingSecretKey | default "token" }}
        path: token
{{- if $tls.enabled }}
- name: worker-tls
  secret:
    {{- if eq $component "controlplane" }}
    secretName: {{ required "tls.worker.controlplaneSecret: the Secret (tls.crt, tls.key, ca.crt) of the controlplane's worker port" $tls.controlplaneSecret }}
    {{- else }}
    secretName: {{ required "tls.worker.workerSecret: the Secret (tls.crt, tls.key, ca.crt) the ranks present" $tls.workerSecret }}
    {{- end }}
    defaultMode: 0440
{{- end }}
{{- if $api.enabled }}
- name: api-tls
  secret:
    secretName: {{ required "tls.api.secret: the Secret (tls.crt, tls.key, ca.crt) of the client API port" $api.secret }}
    defaultMode: 0440
    {{- if ne $component "controlplane" }}
    # The ranks' readiness probe only verifies the API: the CA, not the key.
    items:
      - key: ca.crt
        path: ca.crt
    {{- end }}
{{- if $api.clientAuth }}
- name: probe-tls
  secret:
    secretName: {{ required "tls.api.probeClientSecret: the Secret (tls.crt, tls.key) of the probes' client certificate under tls.api.clientAuth" $api.probeClientSecret }}
    defaultMode: 0440
{{- end }}
{{- end }}
{{- if and (eq $component "controlplane") $ctx.Values.apiKeys.existingSecret }}
- name: api-keys
  secret:
    secretName: {{ $ctx.Values.apiKeys.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ $ctx.Values.apiKeys.existingSecretKey | default "api-keys" }}
        path: keys
{{- end }}
- name: tmp
  emptyDir: {}
- name: home-cache
  emptyDir: {}
{{- end }}

{{- define "kvloom.secretMounts" -}}
{{- $ctx := index . 0 }}
{{- $component := index . 1 }}
- name: auth-token
  mountPath: /etc/kvloom/auth
  readOnly: true
{{- if $ctx.Values.tls.worker.enabled }}
- name: worker-tls
  mountPath: {{ include "kvloom.tlsDir" $ctx }}/worker
  readOnly: true
{{- end }}
{{- if $ctx.Values.tls.api.enabled }}
- name: api-tls
  mountPath: {{ include "kvloom.tlsDir" $ctx }}/api
  readOnly: true
{{- if $ctx.Values.tls.api.clientAuth }}
- name: probe-tls
  mountPath: {{ include "kvloom.tlsDir" $ctx }}/probe
  readOnly: true
{{- end }}
{{- end }}
{{- if and (eq $component "controlplane") $ctx.Values.apiKeys.existingSecret }}
- name: api-keys
  mountPath: /etc/kvloom/api-keys
  readOnly: true
{{- end }}
- name: tmp
  mountPath: /tmp
- name: home-cache
  mountPath: /home/kvloom/.cache
{{- end }}

{{/* `kvloom health` flags that reach the client API under tls.api, one a line. */}}
{{- define "kvloom.healthTlsFlags" -}}
{{- if .Values.tls.api.enabled }}
- --ssl-ca-certs={{ include "kvloom.tlsDir" . }}/api/ca.crt
{{- if .Values.tls.api.clientAuth }}
- --ssl-certfile={{ include "kvloom.tlsDir" . }}/probe/tls.crt
- --ssl-keyfile={{ include "kvloom.tlsDir" . }}/probe/tls.key
{{- end }}
{{- end }}
{{- end }}

{{/*
A controlplane probe: grpc.health.v1 `service` on the API port; under
tls.api an exec of `kvloom health` over TLS (kubelet gRPC probes are plaintext).
*/}}
{{- define "kvloom.controlplaneProbe" -}}
{{- $ctx := index . 0 }}
{{- $service := index . 1 }}
{{- if $ctx.Values.tls.api.enabled }}
exec:
  command:
    - kvloom
    - health
    - --server
    - {{ printf "localhost:%v" $ctx.Values.controlplane.ports.api | quote }}
    - --service
    - {{ $service | quote }}
    {{- with include "kvloom.healthTlsFlags" $ctx | trim }}
    {{- . | nindent 4 }}
    {{- end }}
{{- else }}
grpc:
  port: {{ $ctx.Values.controlplane.ports.api }}
  service: {{ $service | quote }}
{{- end }}
{{- end }}

{{/* Volumes for the model: the PVC and/or the conversion cache. */}}
{{- define "kvloom.modelVolumes" -}}
{{- if .Values.model.volume.enabled }}
- name: model
  persistentVolumeClaim:
    claimName: {{ include "kvloom.modelClaimName" . }}
{{- end }}
{{- if and .Values.model.convertDefaultModel.enabled (not .Values.model.volume.enabled) }}
- name: model-cache
  emptyDir: {}
{{- end }}
{{- end }}

{{/* Mounts matching kvloom.modelVolumes; "readOnly" is a bool argument. */}}
{{- define "kvloom.modelMounts" -}}
{{- $ctx := index . 0 }}
{{- $readOnly := index . 1 }}
{{- if $ctx.Values.model.volume.enabled }}
- name: model
  mountPath: {{ $ctx.Values.model.volume.mountPath }}
  readOnly: {{ $readOnly }}
{{- end }}
{{- if and $ctx.Values.model.convertDefaultModel.enabled (not $ctx.Values.model.volume.enabled) }}
- name: model-cache
  mountPath: /var/cache/kvloom
{{- end }}
{{- end }}

{{/*
The init container that converts the default model (for images built with
PRECONVERT_MODEL=0). Converting is idempotent and locked, so every pod can
run it: the first does the work, the others find the finished directory.
*/}}
{{- define "kvloom.convertInitContainer" -}}
{{- if .Values.model.convertDefaultModel.enabled }}
- name: convert-default-model
  image: {{ include "kvloom.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["python", "-m", "kvloom.common.default_model"]
  env:
    - name: KVLOOM_CACHE_DIR
      value: {{ include "kvloom.cacheDir" . | quote }}
  {{- with .Values.model.convertDefaultModel.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    {{- include "kvloom.modelMounts" (list . false) | trim | nindent 4 }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}

{{/* pd.enabled's refusals, rendered before anything else. */}}
{{- define "kvloom.validatePD" -}}
{{- if .Values.pd.enabled }}
{{- if not .Values.gateway.enabled }}
{{- fail "pd.enabled needs gateway.enabled=true: the SMG gateway sends each request's prefill and decode to their clusters" }}
{{- end }}
{{- if ne (int .Values.replicas) 1 }}
{{- fail "pd.enabled: size it with pd.prefill.replicas and pd.decode.replicas; replicas (alike clusters, without PD) must stay 1" }}
{{- end }}
{{- if hasKey (default dict .Values.pd.kvConnectorExtraConfig) "side_channel_host" }}
{{- fail "pd.kvConnectorExtraConfig.side_channel_host: the chart sets each prefill controlplane's own (its Service's DNS name)" }}
{{- end }}
{{- if .Values.cache.kvOffloadingSize }}
{{- fail "pd.enabled with cache.kvOffloadingSize: one KV connector at a time (the controlplane refuses --kv-transfer-config with --kv-offloading-size)" }}
{{- end }}
{{- end }}
{{- end }}
