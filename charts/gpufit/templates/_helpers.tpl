{{/*
Names, labels and the checks that refuse a configuration that cannot work.
*/}}

{{- define "gpufit.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpufit.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "gpufit.controller.fullname" -}}
{{- printf "%s-controller" (include "gpufit.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpufit.sidecar.fullname" -}}
{{- printf "%s-sidecar" (include "gpufit.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpufit.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpufit.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "gpufit.labels" -}}
helm.sh/chart: {{ include "gpufit.chart" . }}
app.kubernetes.io/name: {{ include "gpufit.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpufit
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "gpufit.controller.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpufit.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: controller
{{- end -}}

{{- define "gpufit.sidecar.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpufit.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: sidecar
{{- end -}}

{{- define "gpufit.controller.serviceAccountName" -}}
{{- if .Values.controller.serviceAccount.create -}}
{{- default (include "gpufit.controller.fullname" .) .Values.controller.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.controller.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "gpufit.sidecar.serviceAccountName" -}}
{{- if .Values.sidecar.serviceAccount.create -}}
{{- default (include "gpufit.sidecar.fullname" .) .Values.sidecar.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.sidecar.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "gpufit.leaseName" -}}
{{- default (include "gpufit.controller.fullname" .) .Values.controller.leaderElection.leaseName -}}
{{- end -}}

{{/* Secret holding the webhook's serving certificate (tls.crt, tls.key). */}}
{{- define "gpufit.webhook.tlsSecret" -}}
{{- if .Values.webhook.tls.certManager.enabled -}}
{{- printf "%s-webhook-tls" (include "gpufit.fullname" .) -}}
{{- else -}}
{{- .Values.webhook.tls.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "gpufit.webhook.certificateName" -}}
{{- printf "%s-webhook" (include "gpufit.fullname" .) -}}
{{- end -}}

{{- define "gpufit.historyClaimName" -}}
{{- default (printf "%s-history" (include "gpufit.fullname" .)) .Values.history.sqlite.persistence.existingClaim -}}
{{- end -}}

{{/*
Refuses values that would install something broken, with a message that says
what to change. Included once, from the controller Deployment and the
sidecar DaemonSet templates (a `fail` aborts the whole render).
*/}}
{{- define "gpufit.validate" -}}
{{- $c := .Values.controller -}}
{{- $replicas := int $c.replicas -}}
{{- if lt $replicas 1 -}}
{{- fail (printf "controller.replicas must be at least 1 (got %v); set controller.enabled=false to run no controller" $c.replicas) -}}
{{- end -}}
{{- if not (has $c.mode (list "Inject" "Recommend")) -}}
{{- fail (printf "controller.mode must be Inject or Recommend (got %q)" $c.mode) -}}
{{- end -}}
{{- if not (has .Values.history.type (list "sqlite" "postgres")) -}}
{{- fail (printf "history.type must be sqlite or postgres (got %q)" .Values.history.type) -}}
{{- end -}}
{{- if and (gt $replicas 1) (eq .Values.history.type "sqlite") -}}
{{- fail (printf "controller.replicas=%d needs a shared history: a SQLite file cannot be shared between replicas. Set history.type=postgres and history.postgres.existingSecret, or controller.replicas=1" $replicas) -}}
{{- end -}}
{{- if and $c.watchNamespace (not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" $c.watchNamespace)) -}}
{{- fail (printf "controller.watchNamespace %q is not a namespace name" $c.watchNamespace) -}}
{{- end -}}
{{- if and $c.watchNamespace .Values.kueue.enabled -}}
{{- fail "controller.watchNamespace cannot be set with kueue.enabled: Kueue's admission checks are on Workloads in every namespace, and a check gpufit never answers holds its quota forever" -}}
{{- end -}}
{{- if and (gt $replicas 1) (not $c.leaderElection.enabled) -}}
{{- fail (printf "controller.replicas=%d needs controller.leaderElection.enabled=true: without a leader every replica would reconcile the same TrainingJobs" $replicas) -}}
{{- end -}}
{{- if and (eq .Values.history.type "postgres") (not .Values.history.postgres.existingSecret) -}}
{{- fail "history.type=postgres needs history.postgres.existingSecret: a Secret whose key history.postgres.key holds the postgres:// URL" -}}
{{- end -}}
{{- if .Values.webhook.enabled -}}
{{- if not (has .Values.webhook.failurePolicy (list "Ignore" "Fail")) -}}
{{- fail (printf "webhook.failurePolicy must be Ignore or Fail (got %q)" .Values.webhook.failurePolicy) -}}
{{- end -}}
{{- $t := int .Values.webhook.timeoutSeconds -}}
{{- if or (lt $t 1) (gt $t 30) -}}
{{- fail (printf "webhook.timeoutSeconds must be between 1 and 30 (got %v)" .Values.webhook.timeoutSeconds) -}}
{{- end -}}
{{- if not .Values.webhook.objectSelector -}}
{{- fail "webhook.objectSelector must not be empty: gpufit only mutates objects that opt in (label gpufit.io/inject: \"true\")" -}}
{{- end -}}
{{- if not .Values.webhook.tls.certManager.enabled -}}
{{- if not .Values.webhook.tls.existingSecret -}}
{{- fail "webhook.tls: either webhook.tls.certManager.enabled=true (needs cert-manager) or webhook.tls.existingSecret (a kubernetes.io/tls Secret) with webhook.tls.caBundle; or webhook.enabled=false" -}}
{{- end -}}
{{- if not .Values.webhook.tls.caBundle -}}
{{- fail "webhook.tls.caBundle is required with webhook.tls.existingSecret: the base64 PEM of the CA that signed the certificate, so the API server can trust the webhook" -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if not (has .Values.sidecar.backend (list "nvml" "inventory" "simulate")) -}}
{{- fail (printf "sidecar.backend must be nvml, inventory or simulate (got %q)" .Values.sidecar.backend) -}}
{{- end -}}
{{- if and .Values.sidecar.enabled (eq .Values.sidecar.backend "inventory") (not .Values.sidecar.inventory) -}}
{{- fail "sidecar.backend=inventory needs sidecar.inventory: the inventory file's content (GPUs described by hand)" -}}
{{- end -}}
{{- end -}}
