{{/*
Chart name, truncated to 63 characters (label value limit).
*/}}
{{- define "migdra.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Object-name prefix. Truncated to 45 characters so that suffixes such as
"-kubelet-plugin-own-gpunode" still fit in 63.
*/}}
{{- define "migdra.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
chart label value: name-version.
*/}}
{{- define "migdra.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels on every object.
*/}}
{{- define "migdra.labels" -}}
helm.sh/chart: {{ include "migdra.chart" . }}
app.kubernetes.io/name: {{ include "migdra.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: migdra
{{- end }}

{{/*
Selector labels of one component. Call with (dict "ctx" $ "component" "controller").
*/}}
{{- define "migdra.selectorLabels" -}}
app.kubernetes.io/name: {{ include "migdra.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
All labels of one component's objects. Call with (dict "ctx" $ "component" "controller").
*/}}
{{- define "migdra.componentLabels" -}}
{{ include "migdra.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
ServiceAccount names.
*/}}
{{- define "migdra.controller.serviceAccountName" -}}
{{- default (printf "%s-controller" (include "migdra.fullname" .)) .Values.controller.serviceAccount.name }}
{{- end }}

{{- define "migdra.kubeletPlugin.serviceAccountName" -}}
{{- default (printf "%s-kubelet-plugin" (include "migdra.fullname" .)) .Values.kubeletPlugin.serviceAccount.name }}
{{- end }}

{{/*
Image reference. Call with (dict "ctx" $ "image" .Values.controller.image); an empty tag means
the chart's appVersion. A non-empty imageRegistry replaces the repository's registry host (its
first path component when that names a host, as the container runtimes read it: it has a "."
or ":" or is "localhost"), or is prefixed to a repository without one.
*/}}
{{- define "migdra.image" -}}
{{- $repository := .image.repository }}
{{- with .ctx.Values.imageRegistry }}
{{- $parts := splitn "/" 2 $repository }}
{{- $first := $parts._0 }}
{{- if and $parts._1 (or (contains "." $first) (contains ":" $first) (eq "localhost" $first)) }}
{{- $repository = $parts._1 }}
{{- end }}
{{- $repository = printf "%s/%s" . $repository }}
{{- end }}
{{- printf "%s:%s" $repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}

{{/*
Host-side listen address "<bindAddress>:<port>" (IPv6 literals get brackets). Call with
(dict "ctx" $ "port" 8080).
*/}}
{{- define "migdra.listenAddress" -}}
{{- $host := default .ctx.Values.metrics.bindAddress .host }}
{{- if contains ":" $host }}
{{- printf "[%s]:%d" $host (int .port) }}
{{- else }}
{{- printf "%s:%d" $host (int .port) }}
{{- end }}
{{- end }}

{{/*
Kubelet root dir without a trailing slash.
*/}}
{{- define "migdra.kubeletRootDir" -}}
{{- $d := trimSuffix "/" .Values.kubeletRootDir }}
{{- required "kubeletRootDir must be an absolute path other than /" $d }}
{{- end }}

{{/*
Where the NVIDIA driver root is mounted inside the plugin container.
*/}}
{{- define "migdra.driverRootMount" -}}
/driver-root
{{- end }}

{{/*
NVML_LIB_PATH: the driver-root mount joined with nvmlLibPath.
*/}}
{{- define "migdra.nvmlLibPath" -}}
{{- printf "%s/%s" (include "migdra.driverRootMount" .) (trimPrefix "/" .Values.nvmlLibPath) }}
{{- end }}

{{/*
The CEL selector shared by all of the driver's classes. Call with the driver name.
*/}}
{{- define "migdra.celDriver" -}}
device.driver == {{ . | quote }}
{{- end }}

{{/*
DeviceClass name of one MIG profile: "<profile>.<mig class>" with "-" -> "-no-", then
"+" and "." -> "-". Call with (dict "ctx" $ "profile" "1g.10gb+me").
*/}}
{{- define "migdra.profileClassName" -}}
{{- $p := .profile | lower | replace "-" "-no-" | replace "+" "-" | replace "." "-" }}
{{- printf "%s.%s" $p .ctx.Values.deviceClasses.mig.name }}
{{- end }}

{{/*
Cross-field checks the schema cannot express.
*/}}
{{- define "migdra.validate" -}}
{{- if and (gt (int .Values.controller.replicas) 1) (not .Values.controller.leaderElection.enabled) }}
{{- fail "controller.replicas > 1 requires controller.leaderElection.enabled: two active controllers would publish conflicting ResourceSlices" }}
{{- end }}
{{- if lt (mul 2 (int .Values.heartbeat.timeoutSeconds)) (mul 3 (int .Values.heartbeat.intervalSeconds)) }}
{{- fail "heartbeat.timeoutSeconds must be at least 1.5 x heartbeat.intervalSeconds (a late heartbeat must not withdraw a node's devices)" }}
{{- end }}
{{- if eq .Values.kubeletPlugin.httpPort .Values.kubeletPlugin.grpcHealthPort }}
{{- fail "kubeletPlugin.httpPort and kubeletPlugin.grpcHealthPort must differ" }}
{{- end }}
{{- if and .Values.deviceClasses.gpu.enabled .Values.deviceClasses.mig.enabled (eq .Values.deviceClasses.gpu.name .Values.deviceClasses.mig.name) }}
{{- fail "deviceClasses.gpu.name and deviceClasses.mig.name must differ" }}
{{- end }}
{{- $surge := toString .Values.kubeletPlugin.maxSurge }}
{{- $unavailable := toString .Values.kubeletPlugin.maxUnavailable }}
{{- if and (has $surge (list "0" "0%")) (has $unavailable (list "0" "0%")) }}
{{- fail "kubeletPlugin.maxSurge and kubeletPlugin.maxUnavailable cannot both be 0 (the DaemonSet could never update)" }}
{{- end }}
{{- end }}
