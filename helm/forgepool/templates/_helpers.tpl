{{/* The release's base name, at most 52 characters so that suffixes fit in 63. */}}
{{- define "forgepool.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "forgepool.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: dispatcher, worker or rabbitmq. */}}
{{- define "forgepool.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "forgepool.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/* How long a SIGTERMed worker waits for its stages: worker.drainSeconds, or (0) the agent
profiles' longest timeout_seconds (1800 for a profile without one) plus 60 s. */}}
{{- define "forgepool.drainSeconds" -}}
{{- if .Values.worker.drainSeconds -}}
{{ .Values.worker.drainSeconds }}
{{- else if .Values.dispatcher.agents.existingConfigMap -}}
1860
{{- else -}}
{{- $longest := 0 -}}
{{- $profiles := (fromToml .Values.dispatcher.agents.toml).agents | default dict -}}
{{- range $name, $profile := $profiles -}}
{{- $timeout := int ($profile.timeout_seconds | default 1800) -}}
{{- if gt $timeout $longest -}}{{- $longest = $timeout -}}{{- end -}}
{{- end -}}
{{ add (max $longest 1800) 60 }}
{{- end -}}
{{- end -}}

{{/* The vhost KEDA reads: rabbitmq.vhost, else the path of the external broker URL (its first node's, when it lists several), else "/". */}}
{{- define "forgepool.vhost" -}}
{{- if .Values.rabbitmq.vhost -}}
{{ .Values.rabbitmq.vhost }}
{{- else if and (eq .Values.rabbitmq.mode "external") .Values.rabbitmq.externalUrl -}}
{{- $path := (urlParse (splitList "," .Values.rabbitmq.externalUrl | first)).path | trimPrefix "/" -}}
{{ $path | default "/" }}
{{- else -}}
/
{{- end -}}
{{- end -}}

{{/* A generated secret: derived from secrets.seed when set (identical at every render), else
random. .name tells the values apart. */}}
{{- define "forgepool.generated" -}}
{{- if .root.Values.secrets.seed -}}
{{ printf "%s/%s/%s/%s" .root.Values.secrets.seed .root.Release.Namespace .root.Release.Name .name | sha256sum | trunc (int .length) }}
{{- else -}}
{{ randAlphaNum (int .length) }}
{{- end -}}
{{- end -}}

{{/* The pod-level escape hatches of a component (dispatcher or worker). */}}
{{- define "forgepool.podExtras" -}}
{{- with .runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "forgepool.secretName" -}}
{{- .Values.secrets.existingSecret | default (include "forgepool.fullname" .) -}}
{{- end -}}

{{- define "forgepool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "forgepool.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{- define "forgepool.rabbitmqHost" -}}
{{ include "forgepool.fullname" . }}-rabbitmq
{{- end -}}

{{/* Environment shared by the dispatcher and the workers: the broker and logging. */}}
{{- define "forgepool.brokerEnv" -}}
{{- if eq .Values.rabbitmq.mode "bundled" }}
- name: RABBITMQ_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "forgepool.secretName" . }}
      key: rabbitmq-password
- name: FORGEPOOL_AMQP_URL
  value: "amqp://{{ .Values.rabbitmq.username }}:$(RABBITMQ_PASSWORD)@{{ include "forgepool.rabbitmqHost" . }}:5672/%2f"
{{- else }}
- name: FORGEPOOL_AMQP_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "forgepool.secretName" . }}
      key: amqp-url
{{- end }}
- name: FORGEPOOL_AMQP_PREFIX
  value: {{ .Values.amqpPrefix | quote }}
- name: FORGEPOOL_JOB_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "forgepool.secretName" . }}
      key: job-key
- name: FORGEPOOL_LOG
  value: {{ .Values.log.level | quote }}
- name: FORGEPOOL_LOG_FORMAT
  value: {{ .Values.log.format | quote }}
{{- end -}}

{{/* A restricted security context for forgepool's own containers. */}}
{{- define "forgepool.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}
