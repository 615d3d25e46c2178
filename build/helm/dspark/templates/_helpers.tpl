{{- define "dspark.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dspark.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "dspark.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dspark.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dspark.labels" -}}
{{ include "dspark.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* DSPARK_<KEY> for every engine setting that is set (maxSeqLen -> DSPARK_MAX_SEQ_LEN). */}}
{{- define "dspark.engineEnv" -}}
{{- range $key, $value := .Values.dspark }}
{{- if ne (toString $value) "" }}
- name: {{ printf "DSPARK_%s" ($key | snakecase | upper) }}
  value: {{ toString $value | quote }}
{{- end }}
{{- end }}
- name: DSPARK_MODELS
  value: {{ .Values.modelStore.mountPath | quote }}
- name: HOME
  value: /tmp
- name: PYTHONDONTWRITEBYTECODE
  value: "1"
{{- end -}}
