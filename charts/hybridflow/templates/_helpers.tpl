{{/*
Names and labels shared by every template.
*/}}

{{- define "hybridflow.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: <release>-<chart> unless the release name already contains the chart name.
Truncated to 63 characters because it names objects and labels.
*/}}
{{- define "hybridflow.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "hybridflow.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "hybridflow.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hybridflow.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "hybridflow.labels" -}}
helm.sh/chart: {{ include "hybridflow.chart" . }}
{{ include "hybridflow.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: hybridflow
{{- end }}

{{- define "hybridflow.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "hybridflow.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "hybridflow.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "hybridflow.runtimeImage" -}}
{{- default (printf "docker.io/hybridflow/runtime:%s" .Chart.AppVersion) .Values.runtimeImage }}
{{- end }}

{{/*
Rules for the namespaced resources the operator reconciles. Bound cluster-wide (ClusterRole) when
watchNamespaces is empty, else once per watched namespace (Role). The operator creates a Role per job
granting get on the job and get/patch on its status to the Ray pods: Kubernetes only lets it grant
what it holds itself, so those verbs must stay here.
*/}}
{{- define "hybridflow.namespacedRules" -}}
- apiGroups: ["hybridflow.io"]
  resources: ["rltrainingjobs"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["hybridflow.io"]
  resources: ["rltrainingjobs/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: ["ray.io"]
  resources: ["rayjobs"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["ray.io"]
  resources: ["rayjobs/status"]
  verbs: ["get"]
- apiGroups: ["ray.io"]
  resources: ["rayclusters"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["configmaps", "serviceaccounts"]
  verbs: ["create", "get", "list", "watch", "patch", "update", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["create", "get", "list", "watch", "patch", "update", "delete"]
{{- end }}

{{/*
Name of the `helm test` pod and of its ServiceAccount and roles (templates/tests/).
*/}}
{{- define "hybridflow.testName" -}}
{{- printf "%s-test" (include "hybridflow.fullname" .) }}
{{- end }}
