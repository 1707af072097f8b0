{{- define "kvxfer-pd.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvxfer-pd.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The values the templates rely on, checked once: a mistake stops `helm install` by name. */}}
{{- define "kvxfer-pd.check" -}}
{{- if not (has .Values.mode (list "pull" "push")) -}}
{{- fail (printf "mode must be pull or push, got %v" .Values.mode) -}}
{{- end -}}
{{- range $role := list "prefill" "decode" -}}
{{- $r := index $.Values $role -}}
{{- if lt (int $r.replicas) 1 -}}
{{- fail (printf "%s.replicas must be at least 1, got %v" $role $r.replicas) -}}
{{- end -}}
{{- if lt (int $r.tensorParallelSize) 1 -}}
{{- fail (printf "%s.tensorParallelSize must be at least 1, got %v" $role $r.tensorParallelSize) -}}
{{- end -}}
{{- end -}}
{{- if lt (int .Values.blockSize) 1 -}}
{{- fail (printf "blockSize must be at least 1, got %v" .Values.blockSize) -}}
{{- end -}}
{{- if lt (int .Values.router.drainSeconds) 0 -}}
{{- fail (printf "router.drainSeconds must be 0 or more, got %v" .Values.router.drainSeconds) -}}
{{- end -}}
{{- if and (not .Values.peerTls.insecure) (eq .Values.peerTls.secretName "") -}}
{{- fail "peerTls.secretName must name the Secret with each engine pod's certificate (or set peerTls.insecure: true)" -}}
{{- end -}}
{{- end -}}

{{/* Each engine pod's address as the router and peers reach it (StatefulSet + headless Service). */}}
{{- define "kvxfer-pd.engineHost" -}}
{{- printf "%s-%s-%d.%s-%s.%s.svc" .fullname .role .index .fullname .role .namespace -}}
{{- end -}}
