#!/usr/bin/env python3
"""Validates rendered manifests offline: built-in kinds against the Kubernetes schemas of
kubernetes-validate (strict: unknown fields fail), the custom resources the chart can create
(KEDA, Prometheus Operator) against the schemas in crd-schemas/. Any other kind fails.

Usage: validate.py KUBERNETES_VERSION FILE..."""
import json
import pathlib
import sys

import jsonschema
import kubernetes_validate
import yaml

HERE = pathlib.Path(__file__).parent
CUSTOM = {
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject.json",
    ("keda.sh/v1alpha1", "TriggerAuthentication"): "triggerauthentication.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule.json",
}


def main() -> int:
    version, files = sys.argv[1], sys.argv[2:]
    failures = 0
    for file in files:
        for doc in yaml.safe_load_all(pathlib.Path(file).read_text()):
            if not doc:
                continue
            what = f"{file}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            key = (doc.get("apiVersion"), doc.get("kind"))
            try:
                if key in CUSTOM:
                    schema = json.loads((HERE / "crd-schemas" / CUSTOM[key]).read_text())
                    jsonschema.validate(doc, schema)
                else:
                    kubernetes_validate.validate(doc, version, strict=True)
                print(f"ok      {what}")
            except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as error:
                failures += 1
                print(f"INVALID {what}: {getattr(error, 'message', error)}")
            except kubernetes_validate.SchemaNotFoundError as error:
                failures += 1
                print(f"UNKNOWN {what}: {error}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
