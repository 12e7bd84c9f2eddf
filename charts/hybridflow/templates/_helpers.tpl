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
Rules for the namespaced resources the operator reconciles: exactly the requests it makes, no more
(tests/test_chart.py holds the allow-list, each verb with its reason). Bound cluster-wide (ClusterRole)
when watchNamespaces is empty, else once per watched namespace (Role). The operator creates a Role per
job granting patch on the job's status to the Ray pods: Kubernetes only lets it grant what it holds
itself, so that verb must stay here.
*/}}
{{- define "hybridflow.namespacedRules" -}}
- apiGroups: ["hybridflow.io"]
  resources: ["rltrainingjobs"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["hybridflow.io"]
  resources: ["rltrainingjobs/status"]
  verbs: ["patch"]
- apiGroups: ["ray.io"]
  resources: ["rayjobs"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["configmaps", "serviceaccounts"]
  verbs: ["get", "create", "patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "patch"]
{{- if .Values.networkPolicy.enabled }}
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch"]
{{- end }}
{{- end }}

{{/*
The peers each job's NetworkPolicy admits besides the job's own pods, as JSON: the operator's pods
(this release's, in its namespace), then networkPolicy.ingressFrom.
*/}}
{{- define "hybridflow.networkPolicyPeers" -}}
{{- $operator := dict "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace)) "podSelector" (dict "matchLabels" (include "hybridflow.selectorLabels" . | fromYaml)) }}
{{- prepend (.Values.networkPolicy.ingressFrom | default list) $operator | toJson }}
{{- end }}

{{/*
Name of the `helm test` pod and of its ServiceAccount and roles (templates/tests/).
*/}}
{{- define "hybridflow.testName" -}}
{{- printf "%s-test" (include "hybridflow.fullname" .) }}
{{- end }}
