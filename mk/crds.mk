# CRD and Helm chart targets (included from the top-level Makefile).
#
#   make crds        regenerate crds/ and the chart's CRD template from the pydantic models
#   make crds-check  fail when the committed CRD files differ from the models (CI)
#   make chart-files regenerate the chart's values.schema.json and README.md from its values model
#   make chart-files-check  fail when those differ from the model (make lint runs it)
#   make chart-lint  helm lint the chart, cluster-wide and namespaced, and render it

CHART_DIR ?= charts/hybridflow
# helm is built from its Go module by e2e/toolchain/build.sh, at the version its wrapper go.mod pins.
HELM_VERSION := $(shell bash e2e/toolchain/build.sh --version helm 2>/dev/null)
HELM_BUILT := $(HYBRIDFLOW_CACHE)/bin/helm-$(HELM_VERSION)/helm
# Such a build assumes Kubernetes 1.20 when no cluster is asked; the chart needs 1.29+ (CEL rules).
KUBE_VERSION ?= 1.34.0
# The pinned build when it is there, else a helm on PATH, else the pinned build, built first (needs Go).
HELM ?= $(firstword $(wildcard $(HELM_BUILT)) $(shell command -v helm 2>/dev/null) $(HELM_BUILT))

.PHONY: crds crds-check chart-files chart-files-check chart-lint

crds: venv
	$(PYTHON) -m hybridflow.api.crd

crds-check: venv
	$(PYTHON) -m hybridflow.api.crd --check

chart-files: venv
	$(PYTHON) -m hybridflow_operator.chart

chart-files-check: venv
	$(PYTHON) -m hybridflow_operator.chart --check

$(HELM_BUILT):
	bash e2e/toolchain/build.sh helm

chart-lint: $(HELM)
	$(HELM) lint --strict --kube-version $(KUBE_VERSION) $(CHART_DIR)
	$(HELM) lint --strict --kube-version $(KUBE_VERSION) $(CHART_DIR) --set 'watchNamespaces={team-a,team-b}'
	$(HELM) lint --strict --kube-version $(KUBE_VERSION) $(CHART_DIR) \
	  --set metrics.serviceMonitor.enabled=true --set metrics.podMonitor.enabled=true
	$(HELM) template hybridflow $(CHART_DIR) --namespace hybridflow-system --kube-version $(KUBE_VERSION) > /dev/null
	$(HELM) template hybridflow $(CHART_DIR) --namespace hybridflow-system --kube-version $(KUBE_VERSION) \
	  --set 'watchNamespaces={team-a,team-b}' --set crds.install=false > /dev/null
