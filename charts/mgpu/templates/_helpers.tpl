{{/*
Names. Object names are <fullname>-<component>: <fullname> is the release
name, followed by the chart name unless the release name already holds it.
Cluster-scoped objects (the ClusterRoles, the admission configurations) get
the same names, so two releases of one name cannot share a cluster.
*/}}
{{- define "mgpu.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "mgpu.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The node side: DaemonSet, ServiceAccount, roles, policy, ConfigMap. */}}
{{- define "mgpu.node.name" -}}
{{- include "mgpu.fullname" . }}-node
{{- end }}

{{/* The webhook: Deployment, Service, ServiceAccount, roles. */}}
{{- define "mgpu.webhook.name" -}}
{{- include "mgpu.fullname" . }}-webhook
{{- end }}

{{/* The Secret the webhook serves TLS from. */}}
{{- define "mgpu.webhook.tlsSecret" -}}
{{- if eq .Values.webhook.tls.source "secret" }}
{{- required "webhook.tls.existingSecret is required when webhook.tls.source is \"secret\"" .Values.webhook.tls.existingSecret }}
{{- else }}
{{- include "mgpu.webhook.name" . }}-tls
{{- end }}
{{- end }}

{{- define "mgpu.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels of every object; call with (dict "ctx" $ "component" "node").
*/}}
{{- define "mgpu.labels" -}}
helm.sh/chart: {{ include "mgpu.chart" .ctx }}
{{ include "mgpu.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: mgpu
{{- end }}

{{/* The labels a selector matches; call as mgpu.labels. */}}
{{- define "mgpu.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mgpu.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "mgpu.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* "true" when the node pods run the metrics exporter. */}}
{{- define "mgpu.metrics.enabled" -}}
{{- if and (eq .Values.mode "image") .Values.node.metrics.enabled }}true{{ end }}
{{- end }}

{{/*
"true" when the chart makes a ServiceMonitor: the exporter runs and
serviceMonitor.enabled is true, or "auto" on a cluster that serves
monitoring.coreos.com/v1 ServiceMonitor.
*/}}
{{- define "mgpu.serviceMonitor.enabled" -}}
{{- $e := toString .Values.node.metrics.serviceMonitor.enabled }}
{{- if include "mgpu.metrics.enabled" . }}
{{- if or (eq $e "true") (and (eq $e "auto") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/ServiceMonitor")) }}true{{ end }}
{{- end }}
{{- end }}

{{/* The node config the installer reads, /etc/mgpu-chart in its container. */}}
{{- define "mgpu.node.chartConfig" -}}/etc/mgpu-chart/config.toml{{- end }}

{{/* The node config the installer writes on the host, as the pods see it. */}}
{{- define "mgpu.node.hostConfig" -}}{{ printf "/host%s/config.toml" .Values.node.configDir }}{{- end }}

{{/*
The node config as TOML (docs/config.md). Strings and numbers are written
with toJson: a JSON string or number is a TOML one.
*/}}
{{- define "mgpu.node.configToml" -}}
{{- $c := .Values.node.config -}}
# mgpu node configuration, from the values of Helm release {{ .Release.Namespace }}/{{ .Release.Name }}.
# The installer writes it to the host's {{ .Values.node.configDir }}/config.toml with prefix
# set to its versioned directory. Every key: docs/config.md.
version = 1
backend = {{ $c.backend | toJson }}
run_dir = {{ $c.run_dir | toJson }}
state_dir = {{ $c.state_dir | toJson }}
cdi_kind = {{ $c.cdi_kind | toJson }}
cdi_spec_dir = {{ $c.cdi_spec_dir | toJson }}

[defaults]
{{- range $k, $v := $c.defaults }}
{{ $k }} = {{ $v | toJson }}
{{- end }}
{{- range $c.devices }}

[[device]]
index = {{ .index | toJson }}
{{- range $k, $v := omit . "index" }}
{{ $k }} = {{ $v | toJson }}
{{- end }}
{{- end }}
{{- with $c.backstop }}

[backstop]
{{- range $k, $v := . }}
{{ $k }} = {{ $v | toJson }}
{{- end }}
{{- end }}
{{- with $c.sim.topology }}

[sim]
topology = [
{{- range . }}
  {{ toJson . }},
{{- end }}
]
{{- end }}
{{- range $c.sim.gpus }}

[[sim.gpu]]
{{- range $k, $v := . }}
{{ $k }} = {{ $v | toJson }}
{{- end }}
{{- end }}
{{- with $c.extraToml }}

{{ . | trim }}
{{- end }}
{{- end }}

{{/*
LD_LIBRARY_PATH of the containers that load NVML from node.driverRoot,
mounted at /driver-root: the library directories of the usual
distributions' driver packages.
*/}}
{{- define "mgpu.node.driverEnv" -}}
{{- if .Values.node.driverRoot -}}
- name: LD_LIBRARY_PATH
  value: /driver-root/usr/lib64:/driver-root/usr/lib/x86_64-linux-gnu:/driver-root/usr/lib/aarch64-linux-gnu:/driver-root/lib64:/driver-root/lib/x86_64-linux-gnu:/driver-root/lib/aarch64-linux-gnu:/driver-root/usr/lib
{{- end }}
{{- end }}

{{- /*
KUBERNETES_SERVICE_HOST and _PORT for client-go's in-cluster configuration
when kubernetesAPI.host is set; nothing otherwise.
*/}}
{{- define "mgpu.apiEnv" -}}
{{- with .Values.kubernetesAPI.host -}}
- name: KUBERNETES_SERVICE_HOST
  value: {{ . | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ $.Values.kubernetesAPI.port | toString | quote }}
{{- end }}
{{- end }}

{{- /* The port of webhook.listen (host:port). */}}
{{- define "mgpu.webhook.port" -}}
{{- last (splitList ":" .Values.webhook.listen) | int -}}
{{- end }}

{{- define "mgpu.node.driverMount" -}}
{{- if .Values.node.driverRoot -}}
- name: driver-root
  mountPath: /driver-root
  readOnly: true
{{- end }}
{{- end }}

{{/*
The host directories the installer writes, mounted where it writes them:
the configuration, the installation and the CDI spec under /host, the
enforcers' run and state directories at their own paths (the hook on the
host and the enforcers in the pod must see one path). The enforcers mount
the same.
*/}}
{{- define "mgpu.node.installMounts" -}}
- name: chart-config
  mountPath: /etc/mgpu-chart
  readOnly: true
- name: host-etc-mgpu
  mountPath: {{ printf "/host%s" .Values.node.configDir }}
- name: install-dir
  mountPath: {{ printf "/host%s" .Values.node.installDir }}
- name: cdi
  mountPath: {{ printf "/host%s" .Values.node.config.cdi_spec_dir }}
- name: run
  mountPath: {{ .Values.node.config.run_dir }}
- name: state
  mountPath: {{ .Values.node.config.state_dir }}
{{- with include "mgpu.node.driverMount" . }}
{{ . }}
{{- end }}
{{- end }}

{{/*
The engine step (node.engine, image mode): node install's and node
uninstall's flags, the mounts of the engine's files (at their own paths)
and of the host's root (read-only, where the restart command runs).
*/}}
{{- define "mgpu.node.engineRestart" -}}
{{- $e := .Values.node.engine -}}
{{- if and $e.name (ne $e.restart "none") -}}
{{- default (printf "systemctl restart %s" $e.name) $e.restart -}}
{{- end -}}
{{- end }}

{{- define "mgpu.node.engineConfigFile" -}}
{{- $e := .Values.node.engine -}}
{{- default (ternary "/etc/containerd/config.toml" "/etc/docker/daemon.json" (eq $e.name "containerd")) $e.configFile -}}
{{- end }}

{{- define "mgpu.node.engineRestartArgs" -}}
{{- with include "mgpu.node.engineRestart" . }}
- --engine-restart
- {{ . | quote }}
- --engine-restart-root
- /host-root
{{- end }}
{{- end }}

{{- define "mgpu.node.engineInstallArgs" -}}
{{- $e := .Values.node.engine -}}
{{- if and $e.name $e.configure }}
- --engine
- {{ $e.name }}
- --engine-config
- {{ include "mgpu.node.engineConfigFile" . | quote }}
{{- if eq $e.name "containerd" }}
- --containerd-version
- {{ $e.containerdVersion | quote }}
- --containerd-drop-in
- {{ $e.containerdDropIn | quote }}
{{- end }}
{{- end }}
{{- include "mgpu.node.engineRestartArgs" . }}
{{- end }}

{{- define "mgpu.node.engineMounts" -}}
{{- $e := .Values.node.engine -}}
{{- if $e.name }}
- name: engine-config
  mountPath: {{ dir (include "mgpu.node.engineConfigFile" .) | quote }}
{{- if eq $e.name "containerd" }}
- name: engine-drop-in
  mountPath: {{ dir $e.containerdDropIn | quote }}
{{- end }}
{{- if include "mgpu.node.engineRestart" . }}
- name: host-root
  mountPath: /host-root
  readOnly: true
{{- end }}
{{- end }}
{{- end }}

{{- define "mgpu.node.engineVolumes" -}}
{{- $e := .Values.node.engine -}}
{{- if $e.name }}
- name: engine-config
  hostPath: {path: {{ dir (include "mgpu.node.engineConfigFile" .) | quote }}, type: DirectoryOrCreate}
{{- if eq $e.name "containerd" }}
- name: engine-drop-in
  hostPath: {path: {{ dir $e.containerdDropIn | quote }}, type: DirectoryOrCreate}
{{- end }}
{{- if include "mgpu.node.engineRestart" . }}
- name: host-root
  hostPath: {path: /, type: Directory}
{{- end }}
{{- end }}
{{- end }}
