{{/* Object name prefix: the release name, or <release>-<chart>. */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.secretName" -}}
{{- printf "%s-secrets" (include "pdserve.fullname" .) -}}
{{- end -}}

{{- define "pdserve.configName" -}}
{{- printf "%s-config" (include "pdserve.fullname" .) -}}
{{- end -}}

{{/* Selector labels of one component: (dict "ctx" $ "component" "decode"). */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ default .ctx.Chart.Name .ctx.Values.nameOverride }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pdserve.labels" -}}
{{ include "pdserve.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- end -}}

{{- define "pdserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* env: the cluster secret, from the chart's Secret. */}}
{{- define "pdserve.clusterSecretEnv" -}}
- name: PDSERVE_CLUSTER_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.secretName" . }}
      key: cluster-secret
{{- end -}}

{{/*
Pod annotations that change when the secret values a pod reads do, so that it restarts with
them (a generated cluster secret is kept across upgrades: it changes nothing). Engines read the
cluster secret only, so new API keys do not restart them. Anyone who may read pods sees the
annotations, so the values go in through a slow derivation (scrypt, in sprig's derivePassword,
whose "user" salts the scrypt step: the release's namespace and name), never a plain hash: the
annotations give no fast test of a guessed API key or cluster secret.
*/}}
{{- define "pdserve.slowDigest" -}}
{{- $ctx := index . 0 -}}
{{- if index . 1 -}}
{{- derivePassword 1 "maximum" (index . 1) (printf "%s/%s" $ctx.Release.Namespace $ctx.Release.Name) (index . 2) -}}
{{- end -}}
{{- end -}}
{{- define "pdserve.secretChecksum" -}}
{{- $secret := include "pdserve.slowDigest" (list . .Values.clusterSecret "pdserve-cluster-secret") -}}
{{- $keys := include "pdserve.slowDigest" (list . (join "," .Values.apiKeys) "pdserve-api-keys") -}}
{{- list $secret $keys | toJson | sha256sum -}}
{{- end -}}
{{- define "pdserve.clusterSecretChecksum" -}}
{{- include "pdserve.slowDigest" (list . .Values.clusterSecret "pdserve-cluster-secret") | toJson | sha256sum -}}
{{- end -}}

{{/* env: the API keys clients must present (comma-separated), when apiKeys is set. */}}
{{- define "pdserve.apiKeyEnv" -}}
{{- if .Values.apiKeys -}}
- name: PDSERVE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.secretName" . }}
      key: api-keys
{{- end -}}
{{- end -}}

{{/* env: one key of the chart's ConfigMap: (dict "ctx" $ "key" "PDSERVE_MODEL"). */}}
{{- define "pdserve.configEnv" -}}
- name: {{ .key }}
  valueFrom:
    configMapKeyRef:
      name: {{ include "pdserve.configName" .ctx }}
      key: {{ .key }}
{{- end -}}
