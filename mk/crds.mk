# CRD and Helm chart targets (included from the top-level Makefile).
#
#   make crds        regenerate crds/ and the chart's CRD template from the pydantic models
#   make crds-check  fail when the committed CRD files differ from the models (CI)
#   make chart-lint  helm lint the chart, cluster-wide and namespaced, and render it

PYTHON ?= .venv/bin/python
CHART_DIR ?= charts/hybridflow
HYBRIDFLOW_CACHE ?= $(HOME)/.cache/hybridflow
# helm is built from its Go module by e2e/toolchain/build.sh, at the version e2e/toolchain/helm/go.mod pins.
HELM_VERSION := $(shell awk '$$1 == "helm.sh/helm/v3" { print $$2; exit }' e2e/toolchain/helm/go.mod 2>/dev/null)
# Such a build assumes Kubernetes 1.20 when no cluster is asked; the chart needs 1.29+ (CEL rules).
KUBE_VERSION ?= 1.34.0
HELM ?= $(firstword $(wildcard $(HYBRIDFLOW_CACHE)/bin/helm-$(HELM_VERSION)/helm) $(shell command -v helm 2>/dev/null))

.PHONY: crds crds-check chart-lint

crds:
	$(PYTHON) -m hybridflow.api.crd

crds-check:
	$(PYTHON) -m hybridflow.api.crd --check

chart-lint:
	@if [ -z "$(HELM)" ]; then \
	  echo "helm not found: run 'bash e2e/toolchain/build.sh helm' (needs Go) or put helm on PATH" >&2; \
	  exit 1; \
	fi
	$(HELM) lint --strict --kube-version $(KUBE_VERSION) $(CHART_DIR)
	$(HELM) lint --strict --kube-version $(KUBE_VERSION) $(CHART_DIR) --set 'watchNamespaces={team-a,team-b}'
	$(HELM) template hybridflow $(CHART_DIR) --namespace hybridflow-system --kube-version $(KUBE_VERSION) > /dev/null
	$(HELM) template hybridflow $(CHART_DIR) --namespace hybridflow-system --kube-version $(KUBE_VERSION) \
	  --set 'watchNamespaces={team-a,team-b}' --set crds.install=false > /dev/null
