{{- define "ncclwatch.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ncclwatch.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ncclwatch.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ncclwatch.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ncclwatch.labels" -}}
{{ include "ncclwatch.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "ncclwatch.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "ncclwatch.pluginFile" -}}
libncclwatch-profiler.so
{{- end -}}

{{/* Settings both services share: Kafka, topics, config file, extra environment. */}}
{{- define "ncclwatch.commonEnv" -}}
- name: NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS
  value: {{ .Values.kafka.bootstrapServers | quote }}
- name: NCCLWATCH_TOPICS_PARTITIONS
  value: {{ .Values.kafka.partitions | quote }}
- name: NCCLWATCH_TOPICS_REPLICATION_FACTOR
  value: {{ .Values.kafka.replicationFactor | quote }}
{{- if .Values.config }}
- name: NCCLWATCH_CONFIG
  value: /etc/ncclwatch/ncclwatch.toml
{{- end }}
{{- range $k, $v := .Values.extraEnv }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end }}
{{- end -}}

{{- define "ncclwatch.envFrom" -}}
{{- if .Values.kafka.existingSecret }}
envFrom:
  - secretRef:
      name: {{ .Values.kafka.existingSecret }}
{{- end }}
{{- end -}}

{{/*
What a training pod's container needs: the plugin, the node's spool, and its job identity
from its own labels/annotations through the downward API (docs/deploy.md, "Job identity").
A label the pod does not carry resolves to "", which ncclwatch skips.
*/}}
{{- define "ncclwatch.trainingEnv" -}}
- name: NCCL_PROFILER_PLUGIN
  value: /opt/ncclwatch/lib/{{ include "ncclwatch.pluginFile" . }}
- name: NCCLWATCH_SPOOL_DIR
  value: /var/spool/ncclwatch
- name: POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: PYTORCHJOB_NAME
  valueFrom: {fieldRef: {fieldPath: "metadata.labels['training.kubeflow.org/job-name']"}}
- name: JOBSET_NAME
  valueFrom: {fieldRef: {fieldPath: "metadata.labels['jobset.sigs.k8s.io/jobset-name']"}}
- name: VC_JOB_NAME
  valueFrom: {fieldRef: {fieldPath: "metadata.annotations['volcano.sh/job-name']"}}
- name: K8S_JOB_NAME
  valueFrom: {fieldRef: {fieldPath: "metadata.labels['batch.kubernetes.io/job-name']"}}
{{- end -}}

{{- define "ncclwatch.trainingMounts" -}}
- name: ncclwatch-plugin
  mountPath: /opt/ncclwatch/lib
  readOnly: true
- name: ncclwatch-spool
  mountPath: /var/spool/ncclwatch
{{- end -}}

{{- define "ncclwatch.trainingVolumes" -}}
{{- if eq .Values.plugin.mode "hostPath" }}
- name: ncclwatch-plugin
  hostPath: {path: {{ .Values.plugin.hostDir }}, type: Directory}
{{- else }}
- name: ncclwatch-plugin
  emptyDir: {}
{{- end }}
- name: ncclwatch-spool
  hostPath: {path: {{ .Values.forwarder.spoolHostPath }}, type: Directory}
{{- end -}}

{{- define "ncclwatch.trainingInitContainers" -}}
{{- if eq .Values.plugin.mode "initContainer" }}
- name: ncclwatch-plugin
  image: {{ include "ncclwatch.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: [cp, /opt/ncclwatch/lib/{{ include "ncclwatch.pluginFile" . }}, /plugin/]
  volumeMounts:
    - name: ncclwatch-plugin
      mountPath: /plugin
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  resources:
    requests: {cpu: 10m, memory: 32Mi}
    limits: {cpu: 100m, memory: 64Mi}
{{- end }}
{{- end -}}
