{{/* Object names: the release name if it says clusterpulse, else RELEASE-clusterpulse, so
the default release "clusterpulse" gives the kustomize base's names (clusterpulse-agent,
clusterpulse-dashboard) that docs and Alertmanager configs use. */}}
{{- define "clusterpulse.fullname" -}}
{{- if contains "clusterpulse" .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-clusterpulse" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "clusterpulse.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride -}}
{{- end -}}

{{/* Labels of every object; "component" is agent or dashboard. */}}
{{- define "clusterpulse.labels" -}}
{{ include "clusterpulse.selectorLabels" . }}
app.kubernetes.io/part-of: clusterpulse
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "clusterpulse.selectorLabels" -}}
app.kubernetes.io/name: clusterpulse-{{ .component }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end -}}

{{/* An image reference: REGISTRY/REPOSITORY@DIGEST when a digest is set (pinned: a
re-pushed tag cannot change what runs), else REGISTRY/REPOSITORY:TAG. */}}
{{- define "clusterpulse.image" -}}
{{- $repo := .image.repository -}}
{{- with .root.Values.imageRegistry }}{{ $repo = printf "%s/%s" (trimSuffix "/" .) $repo }}{{ end -}}
{{- if .image.digest -}}
{{- printf "%s@%s" $repo .image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo (default .root.Chart.AppVersion .image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The container security context of every ClusterPulse container but the agent's. */}}
{{- define "clusterpulse.restricted" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: ["ALL"]}
{{- end -}}

{{/* Where the dashboard reads Alertmanager: alertmanager.url, else the chart's own. */}}
{{- define "clusterpulse.alertmanagerURL" -}}
{{- if .Values.alertmanager.url -}}
{{- .Values.alertmanager.url -}}
{{- else if .Values.alertmanager.server.enabled -}}
{{- printf "http://%s-alertmanager.%s:%v" (include "clusterpulse.fullname" .) (include "clusterpulse.namespace" .) .Values.alertmanager.server.port -}}
{{- else -}}
{{- fail "alertmanager.url is empty and alertmanager.server.enabled is false: say where Alertmanager is" -}}
{{- end -}}
{{- end -}}
