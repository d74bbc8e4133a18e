{{/* The name of every object: the release name, unless overridden. */}}
{{- define "gpushare.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gpushare.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpushare.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpushare.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "gpushare.labels" -}}
{{ include "gpushare.selectorLabels" . }}
app.kubernetes.io/part-of: gpushare
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The namespace of every namespaced object: the release's, unless overridden. */}}
{{- define "gpushare.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride -}}
{{- end -}}
