#!/usr/bin/env python3
"""Checks the gpufit Helm chart without a helm binary or a cluster.

For each value set in CASES it renders charts/gpufit with Helm's own Go
library (PyPI helm-python-sdk), lints it, validates every manifest against the
Kubernetes OpenAPI schemas in strict mode (PyPI kubernetes-validate, offline)
for the oldest and the newest Kubernetes the chart supports, and checks the
invariants the chart promises (docs/helm.md): least-privilege RBAC, an opt-in
webhook that fails open, leader election, a sidecar only on GPU nodes,
consistent Services/ServiceMonitors/TLS wiring, and Grafana dashboards whose
PromQL parses (promtool). Value sets the chart must refuse are rendered too,
and must fail with a message that says what to change (from values.schema.json
for wrong types and enums, from the templates' `fail` for combinations).

Run: bash scripts/helm_venv.sh && .build/helm-venv/bin/python scripts/helm_check.py
     [--dump-args FILE]   also write each case's controller/sidecar command
                          lines and GPUFIT_* env names as JSON (the Rust test
                          parses them with gpufit's own clap definitions).
Exit status 0 when every check passes; 1 with one line per problem otherwise.
"""

from __future__ import annotations

import argparse
import base64
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

try:
    import helm_python as helm
    import kubernetes_validate
    import kubernetes_validate.utils as kv_utils
    import yaml
except ImportError as e:  # pragma: no cover - depends on the environment
    sys.exit(
        f"helm_check: missing Python package ({e}); run `bash scripts/helm_venv.sh` "
        "and use .build/helm-venv/bin/python"
    )

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "gpufit"
RELEASE = "gpufit"
NAMESPACE = "gpufit-system"

# The chart's Chart.yaml kubeVersion floor, and the newest schemas bundled.
KUBE_VERSIONS = ["1.27", kv_utils.latest_version()]

# Kinds kubernetes-validate has no schema for: checked for shape only.
CUSTOM_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("cert-manager.io/v1", "Certificate"),
    ("cert-manager.io/v1", "Issuer"),
    ("kueue.x-k8s.io/v1beta1", "AdmissionCheck"),
    ("kueue.x-k8s.io/v1beta2", "AdmissionCheck"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
}

CLUSTER_SCOPED = {
    "ClusterRole",
    "ClusterRoleBinding",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
    "CustomResourceDefinition",
    "Namespace",
    "AdmissionCheck",
}

# Least privilege: (apiGroup, resource) -> verbs the controller may hold.
# Anything else in a Role/ClusterRole is an error; so is a wildcard.
ALLOWED_RULES: dict[tuple[str, str], set[str]] = {
    ("gpufit.io", "trainingjobs"): {"get", "list", "watch"},
    ("gpufit.io", "trainingjobs/status"): {"get", "patch"},
    ("gpufit.io", "trainingjobs/finalizers"): {"update"},
    ("batch", "jobs"): {"get", "list", "watch", "create", "patch"},
    ("kubeflow.org", "pytorchjobs"): {"get", "list", "watch", "patch"},
    ("jobset.x-k8s.io", "jobsets"): {"get", "list", "watch", "patch"},
    ("trainer.kubeflow.org", "trainjobs"): {"get", "list", "watch", "patch"},
    ("", "pods"): {"get", "list", "watch"},
    ("", "pods/log"): {"get"},
    ("", "nodes"): {"get", "list", "watch"},
    ("", "namespaces"): {"get", "list", "watch"},
    ("events.k8s.io", "events"): {"create", "patch"},
    ("coordination.k8s.io", "leases"): {"get", "create", "update"},
    # Only with kueue.enabled (expect_kueue).
    ("kueue.x-k8s.io", "workloads"): {"get", "list", "watch"},
    ("kueue.x-k8s.io", "workloads/status"): {"patch"},
    ("kueue.x-k8s.io", "admissionchecks"): {"get", "list", "watch"},
    ("kueue.x-k8s.io", "admissionchecks/status"): {"patch"},
    ("kueue.x-k8s.io", "resourceflavors"): {"get"},
    ("kueue.x-k8s.io", "localqueues"): {"get", "list", "watch"},
}
# The webhook for pods of Kueue-queued jobs (kueue.enabled): its own
# failurePolicy and selector, checked by expect_kueue.
PODS_WEBHOOK = "pods.gpufit.io"
TRAINER_PODS_WEBHOOK = "trainer-pods.gpufit.io"
KUEUE_RULES = {k: v for k, v in ALLOWED_RULES.items() if k[0] == "kueue.x-k8s.io"}
# A managedJobsNamespaceSelector as an admin copies it from Kueue's configuration.
KUEUE_SELECTOR = {
    "matchLabels": {"team": "ml"},
    "matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system", "kueue-system"]}],
}
# What the controller cannot work without (when RBAC is rendered).
REQUIRED_CLUSTER_RULES: dict[tuple[str, str], set[str]] = {
    ("gpufit.io", "trainingjobs"): {"get", "list", "watch"},
    ("gpufit.io", "trainingjobs/status"): {"patch"},
    ("batch", "jobs"): {"get", "list", "watch", "create", "patch"},
    ("kubeflow.org", "pytorchjobs"): {"get", "list", "watch", "patch"},
    ("jobset.x-k8s.io", "jobsets"): {"get", "list", "watch", "patch"},
    ("trainer.kubeflow.org", "trainjobs"): {"get", "list", "watch", "patch"},
    ("", "pods"): {"get", "list", "watch"},
    ("", "nodes"): {"list", "watch"},
    ("", "namespaces"): {"list", "watch"},
    ("events.k8s.io", "events"): {"create", "patch"},
}
REQUIRED_LEASE_VERBS = {"get", "create", "update"}

INJECT_LABEL = ("gpufit.io/inject", "true")
GPU_NODE_LABEL = "nvidia.com/gpu.present"
GPU_TAINT = "nvidia.com/gpu"

# A self-signed CA in PEM, base64-encoded as a caBundle would be. Its content
# does not matter to the render; the chart must pass it through unchanged.
FAKE_CA = base64.b64encode(
    b"-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----\n"
).decode()


class Case:
    """One value set: render it, then check what it must (and must not) contain."""

    def __init__(
        self,
        name: str,
        values: dict[str, Any],
        expect: Callable[["Rendered", "Problems"], None] | None = None,
    ):
        self.name = name
        self.values = values
        self.expect = expect


class FailingCase:
    """A value set the chart must refuse, with a message containing `needle`."""

    def __init__(self, name: str, values: dict[str, Any], needle: str):
        self.name = name
        self.values = values
        self.needle = needle


class Problems:
    def __init__(self) -> None:
        self.items: list[str] = []
        self.context = ""

    def add(self, msg: str) -> None:
        self.items.append(f"[{self.context}] {msg}" if self.context else msg)

    def check(self, ok: bool, msg: str) -> bool:
        if not ok:
            self.add(msg)
        return ok


class Rendered:
    """The objects of one render, indexed for the checks."""

    def __init__(self, values: dict[str, Any], merged: dict[str, Any], docs: list[dict]):
        self.values = values
        self.merged = merged
        self.docs = docs

    def of(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d.get("kind") == kind]

    def one(self, kind: str, name_suffix: str = "") -> dict | None:
        found = [d for d in self.of(kind) if d["metadata"]["name"].endswith(name_suffix)]
        return found[0] if len(found) == 1 else None

    def named(self, kind: str, name: str) -> dict | None:
        for d in self.of(kind):
            if d["metadata"]["name"] == name:
                return d
        return None


# ---------------------------------------------------------------- value sets

SECRET_TLS = {
    "webhook": {
        "tls": {
            "certManager": {"enabled": False},
            "existingSecret": "gpufit-webhook-cert",
            "caBundle": FAKE_CA,
        }
    }
}
HA_POSTGRES = {
    "controller": {"replicas": 3, "apiToken": {"existingSecret": "gpufit-api-token"}},
    "history": {"type": "postgres", "postgres": {"existingSecret": "gpufit-history-url"}},
    "prometheus": {"url": "http://prometheus-operated.monitoring.svc:9090"},
}


def expect_defaults(r: Rendered, p: Problems) -> None:
    hook = r.one("MutatingWebhookConfiguration")
    if p.check(hook is not None, "defaults must render one MutatingWebhookConfiguration"):
        for w in hook["webhooks"]:
            p.check(
                w.get("failurePolicy") == "Ignore",
                f"webhook {w['name']}: failurePolicy must default to Ignore (got {w.get('failurePolicy')})",
            )
    p.check(r.one("DaemonSet") is not None, "defaults must render the sidecar DaemonSet")
    p.check(r.of("ServiceMonitor") == [], "ServiceMonitors must be off by default (needs the Prometheus Operator)")
    p.check(r.one("Certificate") is not None, "defaults use cert-manager: a Certificate must be rendered")
    p.check(r.one("PersistentVolumeClaim") is not None, "defaults (sqlite) must render the history PVC")
    dep = r.one("Deployment")
    if dep:
        p.check(dep["spec"]["replicas"] == 1, "defaults run one controller replica")
        p.check(
            dep["spec"].get("strategy", {}).get("type") == "Recreate",
            "a SQLite history on a ReadWriteOnce volume needs the Recreate strategy",
        )
    p.check(len(r.of("ConfigMap")) >= 2, "defaults must ship the dashboard ConfigMaps")
    expect_no_kueue(r, p)


def expect_no_webhook(r: Rendered, p: Problems) -> None:
    p.check(r.of("MutatingWebhookConfiguration") == [], "webhook.enabled=false must render no webhook")
    p.check(r.of("Certificate") == [] and r.of("Issuer") == [], "no webhook: no certificate either")
    dep = r.one("Deployment")
    if dep:
        args = container(dep, "controller").get("args", [])
        p.check(not any(a.startswith("--webhook-listen") for a in args), "no webhook: no --webhook-listen")
    svc = r.one("Service", "-controller")
    if svc:
        p.check(all(pt["name"] != "webhook" for pt in svc["spec"]["ports"]), "no webhook: no webhook port")


def expect_no_sidecar(r: Rendered, p: Problems) -> None:
    p.check(r.of("DaemonSet") == [], "sidecar.enabled=false must render no DaemonSet")
    p.check(r.one("Service", "-sidecar") is None, "sidecar.enabled=false must render no sidecar Service")
    p.check(r.one("Deployment") is not None, "sidecar.enabled=false keeps the controller")


def expect_service_monitors(r: Rendered, p: Problems) -> None:
    sms = r.of("ServiceMonitor")
    p.check(len(sms) == 2, f"serviceMonitor.enabled=true: expected 2 ServiceMonitors (controller, sidecar), got {len(sms)}")
    for sm in sms:
        p.check(
            sm["metadata"]["labels"].get("release") == "kube-prometheus-stack",
            f"ServiceMonitor {sm['metadata']['name']} must carry serviceMonitor.labels",
        )


def expect_secret_tls(r: Rendered, p: Problems) -> None:
    p.check(r.of("Certificate") == [] and r.of("Issuer") == [], "provided-secret TLS renders no cert-manager objects")
    hook = r.one("MutatingWebhookConfiguration")
    if hook:
        p.check(
            "cert-manager.io/inject-ca-from" not in (hook["metadata"].get("annotations") or {}),
            "provided-secret TLS must not ask cert-manager to inject the CA",
        )
        for w in hook["webhooks"]:
            p.check(w["clientConfig"].get("caBundle") == FAKE_CA, "caBundle must be webhook.tls.caBundle, unchanged")
    dep = r.one("Deployment")
    if dep:
        p.check(
            secret_volumes(dep).get("webhook-tls") == "gpufit-webhook-cert",
            "the controller must mount webhook.tls.existingSecret",
        )


def expect_issuer_ref(r: Rendered, p: Problems) -> None:
    p.check(r.of("Issuer") == [], "with issuerRef set the chart must not create its own Issuer")
    cert = r.one("Certificate")
    if cert:
        ref = cert["spec"]["issuerRef"]
        p.check(
            ref == {"name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"},
            f"Certificate issuerRef must follow webhook.tls.certManager.issuerRef (got {ref})",
        )


def expect_ha(r: Rendered, p: Problems) -> None:
    dep = r.one("Deployment")
    if not p.check(dep is not None, "HA: no controller Deployment"):
        return
    p.check(dep["spec"]["replicas"] == 3, "HA: replicas must be 3")
    p.check(r.of("PersistentVolumeClaim") == [], "HA with postgres must not render the SQLite PVC")
    p.check(r.one("PodDisruptionBudget") is not None, "HA: a PodDisruptionBudget keeps one replica up")
    c = container(dep, "controller")
    envs = {e["name"]: e for e in c.get("env", [])}
    ref = envs.get("GPUFIT_HISTORY", {}).get("valueFrom", {}).get("secretKeyRef", {})
    p.check(
        ref == {"name": "gpufit-history-url", "key": "url"},
        "HA: GPUFIT_HISTORY must come from history.postgres.existingSecret (never a literal URL)",
    )
    args = c.get("args", [])
    p.check(not any(a.startswith("--history=") for a in args), "HA: no --history flag (the URL is a secret)")
    p.check(
        any(a.startswith("--prometheus-url=http://prometheus-operated") for a in args),
        "prometheus.url must reach the controller",
    )
    p.check(any(a.startswith("--token-file=") for a in args), "controller.apiToken must become --token-file")
    aff = dep["spec"]["template"]["spec"].get("affinity", {})
    p.check("podAntiAffinity" in aff, "HA: replicas should prefer different nodes")


def expect_recommend_inventory(r: Rendered, p: Problems) -> None:
    dep = r.one("Deployment")
    if dep:
        args = container(dep, "controller").get("args", [])
        p.check("--mode=Recommend" in args, "controller.mode=Recommend must reach the controller")
        vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
        p.check("emptyDir" in vols.get("history", {}), "persistence disabled: history on an emptyDir")
    p.check(r.of("PersistentVolumeClaim") == [], "persistence disabled: no PVC")
    ds = r.one("DaemonSet")
    if ds:
        spec = ds["spec"]["template"]["spec"]
        p.check(spec.get("runtimeClassName") == "nvidia", "sidecar.runtimeClassName must reach the pod")
        args = container(ds, "sidecar").get("args", [])
        p.check("--backend=inventory" in args, "sidecar.backend=inventory must reach the sidecar")
        p.check(any(a.startswith("--inventory=") for a in args), "inventory backend needs --inventory")
    cms = [c for c in r.of("ConfigMap") if c["metadata"]["name"].endswith("-inventory")]
    p.check(len(cms) == 1 and "A100" in json.dumps(cms[0].get("data")), "inventory ConfigMap must hold sidecar.inventory")
    p.check(r.of("ConfigMap") == cms, "dashboards.enabled=false: no dashboard ConfigMaps")


def expect_single_no_leader(r: Rendered, p: Problems) -> None:
    dep = r.one("Deployment")
    if dep:
        args = container(dep, "controller").get("args", [])
        p.check("--no-leader-election" in args, "leaderElection.enabled=false must pass --no-leader-election")
        p.check(not any(a.startswith("--lease-name") for a in args), "no leader election: no --lease-name")
        p.check("--watch-namespace=team-a" in args, "controller.watchNamespace must become --watch-namespace")
        p.check("--cluster=gpu-west" in args, "controller.clusterName must become --cluster")
    p.check(r.of("Role") == [] and r.of("RoleBinding") == [], "no leader election: no lease Role")
    ds = r.one("DaemonSet")
    if ds:
        args = container(ds, "sidecar").get("args", [])
        p.check("--nvml-lib=/usr/lib64/libnvidia-ml.so.1" in args, "sidecar.nvmlLib must become --nvml-lib")
        p.check("--interval=50ms" in args, "sidecar.interval must become --interval")


def expect_sidecar_only(r: Rendered, p: Problems) -> None:
    p.check(r.of("Deployment") == [], "controller.enabled=false: no Deployment")
    p.check(r.of("ClusterRole") == [], "controller.enabled=false: no RBAC")
    p.check(r.of("MutatingWebhookConfiguration") == [], "controller.enabled=false: no webhook (nothing would serve it)")
    p.check(r.one("DaemonSet") is not None, "controller.enabled=false keeps the sidecar")


def kueue_grants(r: Rendered) -> dict[tuple[str, str], set[str]]:
    granted: dict[tuple[str, str], set[str]] = {}
    for role in r.of("ClusterRole"):
        for rule in role.get("rules", []):
            for g in rule.get("apiGroups", []):
                for res in rule.get("resources", []):
                    if g == "kueue.x-k8s.io":
                        granted.setdefault((g, res), set()).update(rule.get("verbs", []))
    return granted


def expect_kueue(r: Rendered, p: Problems) -> None:
    dep = r.one("Deployment")
    if dep:
        p.check("--kueue" in container(dep, "controller").get("args", []), "kueue.enabled must pass --kueue")
    p.check(kueue_grants(r) == KUEUE_RULES, f"kueue.enabled: RBAC on Kueue must be {KUEUE_RULES}, got {kueue_grants(r)}")
    hook = r.one("MutatingWebhookConfiguration")
    if hook:
        pods = [w for w in hook["webhooks"] if w["name"] == PODS_WEBHOOK]
        if p.check(len(pods) == 1, f"kueue.enabled: the {PODS_WEBHOOK} webhook must be rendered"):
            w = pods[0]
            p.check(w.get("failurePolicy") == r.merged["webhook"]["podFailurePolicy"], "the pods webhook's failurePolicy must follow webhook.podFailurePolicy")
            p.check((w.get("objectSelector") or {}).get("matchLabels") == {"gpufit.io/deferred": "true"}, "the pods webhook must match only gpufit's deferred pods")
            p.check([x["resources"] for x in w["rules"]] == [["pods"]], "the pods webhook handles pods only")
        trainer = [w for w in hook["webhooks"] if w["name"] == TRAINER_PODS_WEBHOOK]
        if p.check(len(trainer) == 1, f"kueue.enabled with webhook.trainJobs: the {TRAINER_PODS_WEBHOOK} webhook must be rendered"):
            w = trainer[0]
            p.check(w.get("failurePolicy") == "Ignore", "the TrainJob pods webhook sees pods gpufit did not configure: failurePolicy Ignore")
            p.check((w.get("objectSelector") or {}).get("matchLabels") == {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}, "the TrainJob pods webhook matches trainer pods only")
    checks = r.of("AdmissionCheck")
    if p.check(len(checks) == 1, f"kueue.enabled: one AdmissionCheck, got {len(checks)}"):
        p.check(checks[0]["spec"].get("controllerName") == "gpufit.io/advisor", "the AdmissionCheck's controllerName must be gpufit.io/advisor")
        p.check(checks[0]["metadata"]["name"] == "gpu-advisor", "kueue.admissionCheck.name names it")


def expect_kueue_integrations_alert(r: Rendered, p: Problems) -> None:
    expect_kueue_without_check(r, p)
    dep = r.one("Deployment")
    if dep:
        args = container(dep, "controller").get("args", [])
        p.check("--kueue-integrations=batch/job,kubeflow.org/pytorchjob" in args, f"kueue.integrations must pass --kueue-integrations, got {args}")
    rules = r.of("PrometheusRule")
    if p.check(len(rules) == 1, "kueue.alert.enabled: one PrometheusRule"):
        alerts = {x["alert"] for g in rules[0]["spec"]["groups"] for x in g["rules"]}
        p.check(alerts == {"GpufitKueueCheckPending", "GpufitKueueAnswererDown"}, f"alerts: {alerts}")


def expect_kueue_without_check(r: Rendered, p: Problems) -> None:
    p.check(r.of("AdmissionCheck") == [], "kueue.admissionCheck.create=false: no AdmissionCheck")
    p.check(kueue_grants(r) == KUEUE_RULES, "kueue.enabled keeps its RBAC without the AdmissionCheck object")


def expect_kueue_unlabelled(r: Rendered, p: Problems) -> None:
    dep = r.one("Deployment")
    if dep:
        args = container(dep, "controller").get("args", [])
        p.check("--kueue-manage-jobs-without-queue-name" in args, "kueue.manageJobsWithoutQueueName must pass --kueue-manage-jobs-without-queue-name")
        sel = [a.split("=", 1)[1] for a in args if a.startswith("--kueue-managed-jobs-namespace-selector=")]
        if p.check(len(sel) == 1, f"kueue.managedJobsNamespaceSelector must pass the selector once, got {args}"):
            p.check(json.loads(sel[0]) == KUEUE_SELECTOR, f"the selector must travel as JSON, got {sel[0]}")


def expect_kueue_unlabelled_default_selector(r: Rendered, p: Problems) -> None:
    dep = r.one("Deployment")
    if dep:
        args = container(dep, "controller").get("args", [])
        p.check("--kueue-manage-jobs-without-queue-name" in args, "kueue.manageJobsWithoutQueueName must pass its flag")
        p.check(not any(a.startswith("--kueue-managed-jobs-namespace-selector") for a in args), "an empty selector leaves gpufit's default (Kueue's)")


def expect_no_kueue(r: Rendered, p: Problems) -> None:
    p.check(r.of("AdmissionCheck") == [], "kueue disabled: no AdmissionCheck")
    p.check(kueue_grants(r) == {}, "kueue disabled: no RBAC on Kueue")
    dep = r.one("Deployment")
    if dep:
        args = container(dep, "controller").get("args", [])
        p.check("--kueue" not in args, "kueue disabled: no --kueue")
        p.check(not any(a.startswith("--kueue-") for a in args), "kueue disabled: no Kueue flags")


CASES: list[Case] = [
    Case("defaults", {}, expect_defaults),
    Case("kueue", {"kueue": {"enabled": True, "admissionCheck": {"name": "gpu-advisor"}}}, expect_kueue),
    Case(
        "kueue-manage-unlabelled",
        {"kueue": {"enabled": True, "manageJobsWithoutQueueName": True, "managedJobsNamespaceSelector": KUEUE_SELECTOR}},
        expect_kueue_unlabelled,
    ),
    Case("kueue-manage-unlabelled-default-selector", {"kueue": {"enabled": True, "manageJobsWithoutQueueName": True}}, expect_kueue_unlabelled_default_selector),
    Case("kueue-no-admission-check", {"kueue": {"enabled": True, "admissionCheck": {"create": False}}}, expect_kueue_without_check),
    Case(
        "kueue-integrations-alert",
        {"kueue": {"enabled": True, "admissionCheck": {"create": False}, "integrations": ["batch/job", "kubeflow.org/pytorchjob"], "alert": {"enabled": True}}},
        expect_kueue_integrations_alert,
    ),
    Case("webhook-disabled", {"webhook": {"enabled": False}}, expect_no_webhook),
    Case("sidecar-disabled", {"sidecar": {"enabled": False}}, expect_no_sidecar),
    Case(
        "servicemonitor-enabled",
        {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
        expect_service_monitors,
    ),
    Case("tls-cert-manager-issuer", {"webhook": {"tls": {"certManager": {"issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"}}}}}, expect_issuer_ref),
    Case("tls-provided-secret", SECRET_TLS, expect_secret_tls),
    Case("ha-postgres", HA_POSTGRES, expect_ha),
    Case(
        "recommend-inventory-no-persistence",
        {
            "controller": {"mode": "Recommend"},
            "history": {"sqlite": {"persistence": {"enabled": False}}},
            "sidecar": {
                "backend": "inventory",
                "runtimeClassName": "nvidia",
                "inventory": "gpus:\n  - {name: NVIDIA A100-SXM4-80GB, count: 8, memory_gib: 80}\n",
            },
            "dashboards": {"enabled": False},
        },
        expect_recommend_inventory,
    ),
    Case(
        "single-replica-no-leader-election",
        {
            "controller": {"leaderElection": {"enabled": False}, "watchNamespace": "team-a", "clusterName": "gpu-west"},
            "sidecar": {"readOtherUsersProcesses": True, "migMonitoring": True, "nvmlLib": "/usr/lib64/libnvidia-ml.so.1", "interval": "50ms"},
        },
        expect_single_no_leader,
    ),
    Case("sidecar-only", {"controller": {"enabled": False}}, expect_sidecar_only),
]

FAILING: list[FailingCase] = [
    FailingCase("replicas>1 with sqlite", {"controller": {"replicas": 2}}, "history.type=postgres"),
    FailingCase(
        "replicas>1 without leader election",
        {**HA_POSTGRES, "controller": {"replicas": 2, "leaderElection": {"enabled": False}}},
        "leaderElection.enabled=true",
    ),
    FailingCase("postgres without a secret", {"history": {"type": "postgres"}}, "history.postgres.existingSecret"),
    FailingCase(
        "kueue with a namespace-limited controller",
        {"kueue": {"enabled": True}, "controller": {"watchNamespace": "ml"}},
        "cannot be set with kueue.enabled",
    ),
    FailingCase("unknown history type", {"history": {"type": "mysql"}}, "/history/type"),
    FailingCase("unknown mode", {"controller": {"mode": "Mutate"}}, "/controller/mode"),
    FailingCase(
        "no TLS source",
        {"webhook": {"tls": {"certManager": {"enabled": False}}}},
        "webhook.tls.existingSecret",
    ),
    FailingCase(
        "provided TLS secret without CA bundle",
        {"webhook": {"tls": {"certManager": {"enabled": False}, "existingSecret": "x"}}},
        "webhook.tls.caBundle",
    ),
    FailingCase("bad failurePolicy", {"webhook": {"failurePolicy": "Maybe"}}, "/webhook/failurePolicy"),
    FailingCase("webhook timeout too long", {"webhook": {"timeoutSeconds": 60}}, "timeoutSeconds"),
    FailingCase("webhook matching everything", {"webhook": {"objectSelector": None}}, "objectSelector must not be empty"),
    FailingCase("inventory backend without inventory", {"sidecar": {"backend": "inventory"}}, "sidecar.inventory"),
    FailingCase("unknown sidecar backend", {"sidecar": {"backend": "dcgm"}}, "/sidecar/backend"),
    FailingCase("replicas not a number", {"controller": {"replicas": "three"}}, "/controller/replicas"),
    FailingCase("sidecar interval not a duration", {"sidecar": {"interval": "fast"}}, "/sidecar/interval"),
    FailingCase("bad watch namespace", {"controller": {"watchNamespace": "Team A"}}, "not a namespace name"),
    FailingCase("zero replicas", {"controller": {"replicas": 0}}, "/controller/replicas"),
    FailingCase(
        "Kueue namespace selector with an unknown operator",
        {"kueue": {"enabled": True, "manageJobsWithoutQueueName": True,
                   "managedJobsNamespaceSelector": {"matchExpressions": [{"key": "team", "operator": "Near"}]}}},
        "managedJobsNamespaceSelector",
    ),
]


# ---------------------------------------------------------------- helpers


def container(workload: dict, name: str) -> dict:
    for c in workload["spec"]["template"]["spec"].get("containers", []):
        if c["name"] == name:
            return c
    return {}


def secret_volumes(workload: dict) -> dict[str, str]:
    out = {}
    for v in workload["spec"]["template"]["spec"].get("volumes", []):
        if "secret" in v:
            out[v["name"]] = v["secret"].get("secretName")
    return out


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def parse_manifests(rendered: dict[str, str], p: Problems) -> list[dict]:
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        try:
            loaded = list(yaml.safe_load_all(text))
        except yaml.YAMLError as e:
            p.add(f"{path}: not valid YAML: {e}")
            continue
        for d in loaded:
            if d is None:
                continue
            if not isinstance(d, dict):
                p.add(f"{path}: a document is not a mapping: {str(d)[:80]}")
                continue
            d["__source__"] = path
            docs.append(d)
    return docs


# ---------------------------------------------------------------- schema validation


def validate_schema(doc: dict, p: Problems) -> None:
    src = doc.get("__source__", "?")
    clean = {k: v for k, v in doc.items() if k != "__source__"}
    for key in ("apiVersion", "kind", "metadata"):
        if not p.check(key in clean, f"{src}: missing {key}"):
            return
    meta = clean["metadata"]
    what = f"{src}: {clean['kind']}/{meta.get('name')}"
    p.check(isinstance(meta.get("name"), str) and meta["name"], f"{what}: metadata.name missing")
    p.check(
        len(meta.get("name", "")) <= 63 or clean["kind"] in CLUSTER_SCOPED,
        f"{what}: name longer than 63 characters",
    )
    if clean["kind"] in CLUSTER_SCOPED:
        p.check("namespace" not in meta, f"{what}: cluster-scoped object must not set a namespace")
    elif not (clean["kind"] == "ConfigMap" and meta.get("namespace") not in (None, NAMESPACE)):
        p.check(meta.get("namespace") == NAMESPACE, f"{what}: namespace must be the release namespace")
    if (clean["apiVersion"], clean["kind"]) in CUSTOM_KINDS:
        p.check(isinstance(clean.get("spec"), dict), f"{what}: custom resource without a spec")
        return
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(clean, version, strict=True)
        except kv_utils.SchemaNotFoundError as e:
            p.add(f"{what}: unknown kind for Kubernetes {version}: {e.message}")
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(x) for x in e.path)
            p.add(f"{what}: invalid for Kubernetes {version} at {path or '<root>'}: {e.message}")


# ---------------------------------------------------------------- invariants


def check_rbac(r: Rendered, p: Problems) -> None:
    granted: dict[tuple[str, str], set[str]] = {}
    lease_granted: set[str] = set()
    lease_names: set[str] = set()
    for role in r.of("ClusterRole") + r.of("Role"):
        name = f"{role['kind']}/{role['metadata']['name']}"
        for rule in role.get("rules", []):
            groups, resources, verbs = rule.get("apiGroups", []), rule.get("resources", []), rule.get("verbs", [])
            p.check(rule.get("nonResourceURLs") is None, f"{name}: nonResourceURLs are not needed")
            for field, items in (("apiGroups", groups), ("resources", resources), ("verbs", verbs)):
                p.check("*" not in items, f"{name}: wildcard in {field} ({items}) — list what is needed")
            for g in groups:
                for res in resources:
                    allowed = ALLOWED_RULES.get((g, res))
                    if not p.check(allowed is not None, f"{name}: grants {res!r} in group {g!r}, which gpufit does not need"):
                        continue
                    extra = set(verbs) - allowed
                    p.check(not extra, f"{name}: {res!r} in {g!r} grants {sorted(extra)} beyond {sorted(allowed)}")
                    if res == "leases":
                        p.check(role["kind"] == "Role", f"{name}: leases belong in a namespaced Role, not cluster-wide")
                        lease_granted |= set(verbs)
                        lease_names |= set(rule.get("resourceNames", []))
                    else:
                        granted.setdefault((g, res), set()).update(verbs)
    ctrl = r.merged["controller"]
    if not (r.merged["rbac"]["create"] and ctrl["enabled"]):
        p.check(not r.of("ClusterRole") and not r.of("Role"), "RBAC rendered although disabled")
        return
    for key, verbs in REQUIRED_CLUSTER_RULES.items():
        missing = verbs - granted.get(key, set())
        p.check(not missing, f"ClusterRole lacks {sorted(missing)} on {key[1]!r} ({key[0] or 'core'}): the controller needs them")
    dep = r.one("Deployment")
    if ctrl["leaderElection"]["enabled"]:
        missing = REQUIRED_LEASE_VERBS - lease_granted
        p.check(not missing, f"leader election needs {sorted(missing)} on leases")
        if dep:
            lease_args = [a.split("=", 1)[1] for a in container(dep, "controller").get("args", []) if a.startswith("--lease-name=")]
            p.check(len(lease_args) == 1, "leader election on: exactly one --lease-name")
            if lease_args:
                p.check(
                    lease_names == {lease_args[0]},
                    f"the lease Role must be limited to the Lease the controller uses ({lease_args[0]}), got {sorted(lease_names)}",
                )
    else:
        p.check(not lease_granted, "leader election off: no lease permissions")
    # Every binding points at a rendered role and at the controller's ServiceAccount.
    sa = dep["spec"]["template"]["spec"].get("serviceAccountName") if dep else None
    for b in r.of("ClusterRoleBinding") + r.of("RoleBinding"):
        ref = b["roleRef"]
        p.check(r.named(ref["kind"], ref["name"]) is not None, f"{b['kind']}/{b['metadata']['name']}: roleRef {ref['kind']}/{ref['name']} is not rendered")
        for s in b.get("subjects", []):
            p.check(
                s.get("kind") == "ServiceAccount" and s.get("name") == sa and s.get("namespace") == NAMESPACE,
                f"{b['kind']}/{b['metadata']['name']}: subject {s} is not the controller's ServiceAccount {sa}",
            )
    if ctrl["serviceAccount"]["create"] and sa:
        p.check(r.named("ServiceAccount", sa) is not None, f"ServiceAccount {sa} is used but not rendered")


def check_webhook(r: Rendered, p: Problems) -> None:
    hooks = r.of("MutatingWebhookConfiguration")
    want = r.merged["webhook"]["enabled"] and r.merged["controller"]["enabled"]
    p.check(len(hooks) == (1 if want else 0), f"expected {1 if want else 0} MutatingWebhookConfiguration, got {len(hooks)}")
    if not hooks:
        return
    hook = hooks[0]
    tls = r.merged["webhook"]["tls"]
    annotations = hook["metadata"].get("annotations") or {}
    dep = r.one("Deployment")
    svc = r.one("Service", "-controller")
    for w in hook["webhooks"]:
        name = f"webhook {w['name']}"
        if w["name"] in (PODS_WEBHOOK, TRAINER_PODS_WEBHOOK):
            continue
        p.check(w.get("reinvocationPolicy") == "IfNeeded", f"{name}: reinvocationPolicy must be IfNeeded (Kueue's webhook may run after gpufit's)")
        p.check(w.get("failurePolicy") == r.merged["webhook"]["failurePolicy"], f"{name}: failurePolicy must follow webhook.failurePolicy")
        p.check(w.get("sideEffects") == "None", f"{name}: sideEffects must be None (the webhook writes nothing else)")
        p.check(w.get("admissionReviewVersions") == ["v1"], f"{name}: admissionReviewVersions must be [v1]")
        p.check(1 <= w.get("timeoutSeconds", 10) <= 30, f"{name}: timeoutSeconds out of range")
        # Opt-in: annotations cannot be selected on, so the label is the gate.
        sel = w.get("objectSelector") or {}
        labels = sel.get("matchLabels") or {}
        exprs = sel.get("matchExpressions") or []
        opted_in = labels.get(INJECT_LABEL[0]) == INJECT_LABEL[1] or any(
            e.get("key") == INJECT_LABEL[0] and e.get("operator") == "In" and e.get("values") == [INJECT_LABEL[1]]
            for e in exprs
        )
        p.check(opted_in, f"{name}: objectSelector must require the label {INJECT_LABEL[0]}={INJECT_LABEL[1]!r} (opt-in only)")
        ns_exprs = (w.get("namespaceSelector") or {}).get("matchExpressions") or []
        excluded = {v for e in ns_exprs if e.get("key") == "kubernetes.io/metadata.name" and e.get("operator") == "NotIn" for v in e.get("values", [])}
        p.check({"kube-system", NAMESPACE} <= excluded, f"{name}: namespaceSelector must exclude kube-system and the release namespace")
        targets = set()
        for rule in w.get("rules", []):
            p.check(rule.get("operations") == ["CREATE"], f"{name}: only CREATE is mutated (got {rule.get('operations')})")
            for g in rule["apiGroups"]:
                for v in rule["apiVersions"]:
                    for res in rule["resources"]:
                        p.check("*" not in (g, v, res), f"{name}: wildcard in rules")
                        targets.add(f"{g}/{v}/{res}")
        optional = {"pytorchJobs": "kubeflow.org/v1/pytorchjobs",
                    "jobSets": "jobset.x-k8s.io/v1alpha2/jobsets",
                    "trainJobs": "trainer.kubeflow.org/v1alpha1/trainjobs"}
        expected = {"batch/v1/jobs"} | {t for k, t in optional.items() if r.merged["webhook"].get(k)}
        p.check(targets == expected, f"{name}: rules must match exactly {sorted(expected)} (got {sorted(targets)})")
        cc = w["clientConfig"]
        p.check("url" not in cc, f"{name}: clientConfig must use the in-cluster Service")
        s = cc.get("service", {})
        p.check(svc is not None and s.get("name") == svc["metadata"]["name"] and s.get("namespace") == NAMESPACE,
                f"{name}: clientConfig.service must be the controller Service")
        if svc:
            port = next((pt for pt in svc["spec"]["ports"] if pt["port"] == s.get("port", 443)), None)
            p.check(port is not None and port.get("name") == "webhook", f"{name}: Service has no webhook port {s.get('port', 443)}")
        if tls["certManager"]["enabled"]:
            p.check("caBundle" not in cc, f"{name}: with cert-manager the caBundle is injected, not templated")
        else:
            p.check(bool(cc.get("caBundle")), f"{name}: provided-secret TLS needs a caBundle")
    # TLS wiring: the Deployment mounts the Secret the Certificate writes.
    tls_secret = secret_volumes(dep).get("webhook-tls") if dep else None
    p.check(bool(tls_secret), "the controller must mount the webhook TLS Secret")
    if tls["certManager"]["enabled"]:
        cert = r.one("Certificate")
        if p.check(cert is not None, "cert-manager TLS: a Certificate must be rendered"):
            ref = f"{NAMESPACE}/{cert['metadata']['name']}"
            p.check(annotations.get("cert-manager.io/inject-ca-from") == ref, f"webhook must carry cert-manager.io/inject-ca-from: {ref}")
            p.check(cert["spec"]["secretName"] == tls_secret, "the Certificate's secretName must be what the controller mounts")
            if svc:
                dns = f"{svc['metadata']['name']}.{NAMESPACE}.svc"
                p.check(dns in cert["spec"].get("dnsNames", []), f"the Certificate must be valid for {dns}")
            issuer = cert["spec"]["issuerRef"]
            if issuer.get("kind") == "Issuer":
                p.check(r.named("Issuer", issuer["name"]) is not None or bool(tls["certManager"]["issuerRef"]),
                        f"Certificate refers to Issuer {issuer['name']}, which is not rendered")
    if dep:
        args = container(dep, "controller").get("args", [])
        cert_paths = [a.split("=", 1)[1] for a in args if a.startswith(("--tls-cert=", "--tls-key="))]
        mounts = {m["name"]: m["mountPath"] for m in container(dep, "controller").get("volumeMounts", [])}
        p.check(len(cert_paths) == 2 and all(c.startswith(mounts.get("webhook-tls", "//")) for c in cert_paths),
                "--tls-cert/--tls-key must point into the mounted TLS Secret")
        ports = {pt["name"] for pt in container(dep, "controller").get("ports", [])}
        p.check("webhook" in ports, "the controller container must expose the webhook port")


def check_controller(r: Rendered, p: Problems) -> None:
    deps = r.of("Deployment")
    if not r.merged["controller"]["enabled"]:
        p.check(not deps, "controller disabled but a Deployment was rendered")
        return
    if not p.check(len(deps) == 1, f"expected one controller Deployment, got {len(deps)}"):
        return
    dep = deps[0]
    spec = dep["spec"]["template"]["spec"]
    c = container(dep, "controller")
    p.check(c.get("command") == ["gpufit"], "the controller container runs the gpufit binary")
    args = c.get("args", [])
    p.check(args[:1] == ["controller"], "the controller container runs `gpufit controller`")
    p.check(any(a.startswith("--listen=") for a in args), "the controller needs --listen")
    p.check(dep["spec"]["replicas"] == r.merged["controller"]["replicas"], "replicas must follow controller.replicas")
    if dep["spec"]["replicas"] > 1:
        p.check(r.merged["controller"]["leaderElection"]["enabled"], "replicas > 1 without leader election")
        p.check(r.merged["history"]["type"] == "postgres", "replicas > 1 with a SQLite history")
    envs = {e["name"] for e in c.get("env", [])}
    p.check({"POD_NAME", "POD_NAMESPACE"} <= envs, "POD_NAME and POD_NAMESPACE (Lease identity) must be set")
    sc = c.get("securityContext", {})
    p.check(sc.get("allowPrivilegeEscalation") is False and sc.get("readOnlyRootFilesystem") is True,
            "the controller runs without privilege escalation on a read-only root filesystem")
    p.check(spec.get("securityContext", {}).get("runAsNonRoot") is True, "the controller runs as non-root")
    p.check("livenessProbe" in c and "readinessProbe" in c, "the controller needs liveness and readiness probes")
    if r.merged["history"]["type"] == "sqlite":
        hist = [a for a in args if a.startswith("--history=sqlite:")]
        mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
        p.check(len(hist) == 1 and "history" in mounts and hist[0].split(":", 1)[1].startswith(mounts["history"] + "/"),
                "the SQLite file must live on the mounted history volume")
    svc = r.one("Service", "-controller")
    if p.check(svc is not None, "the controller needs a Service"):
        check_service_targets(svc, dep, p)
        p.check(any(pt["name"] == "http" for pt in svc["spec"]["ports"]), "the controller Service needs the http port")


def check_service_targets(svc: dict, workload: dict, p: Problems) -> None:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    sel = svc["spec"]["selector"]
    name = f"Service/{svc['metadata']['name']}"
    p.check(all(labels.get(k) == v for k, v in sel.items()), f"{name}: selector {sel} does not match the pods")
    p.check(workload["spec"]["selector"]["matchLabels"].items() <= labels.items(), f"{workload['kind']}: selector does not match its own pods")
    port_names = {pt["name"] for c in workload["spec"]["template"]["spec"]["containers"] for pt in c.get("ports", [])}
    for pt in svc["spec"]["ports"]:
        tp = pt.get("targetPort")
        if isinstance(tp, str):
            p.check(tp in port_names, f"{name}: targetPort {tp!r} is not a container port name")


def check_sidecar(r: Rendered, p: Problems) -> None:
    dss = r.of("DaemonSet")
    if not r.merged["sidecar"]["enabled"]:
        p.check(not dss, "sidecar disabled but a DaemonSet was rendered")
        return
    if not p.check(len(dss) == 1, f"expected one sidecar DaemonSet, got {len(dss)}"):
        return
    ds = dss[0]
    spec = ds["spec"]["template"]["spec"]
    c = container(ds, "sidecar")
    args = c.get("args", [])
    p.check(c.get("command") == ["gpufit"] and args[:1] == ["sidecar"], "the DaemonSet runs `gpufit sidecar`")
    p.check(f"--backend={r.merged['sidecar']['backend']}" in args, "--backend must follow sidecar.backend")
    p.check(f"--listen=0.0.0.0:{r.merged['sidecar']['port']}" in args, "the sidecar must listen on all addresses (Prometheus scrapes it)")
    p.check(spec.get("hostPID") is True, "the sidecar needs hostPID to attribute GPU processes to pods")
    # Only GPU nodes: a nodeSelector or a required node affinity on the GFD label.
    on_gpu = spec.get("nodeSelector", {}).get(GPU_NODE_LABEL) == "true"
    for term in (spec.get("affinity", {}).get("nodeAffinity", {})
                 .get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", [])):
        if any(e.get("key") == GPU_NODE_LABEL for e in term.get("matchExpressions", [])):
            on_gpu = True
    p.check(on_gpu, f"the sidecar must be scheduled only on GPU nodes ({GPU_NODE_LABEL}=true)")
    p.check(any(t.get("key") == GPU_TAINT and t.get("operator") == "Exists" for t in spec.get("tolerations", [])),
            f"the sidecar must tolerate the {GPU_TAINT} taint")
    limits = c.get("resources", {}).get("limits", {})
    requests = c.get("resources", {}).get("requests", {})
    p.check("nvidia.com/gpu" not in limits and "nvidia.com/gpu" not in requests,
            "the sidecar must not request a GPU (it would take one away from training)")
    sc = c.get("securityContext", {})
    p.check(not sc.get("privileged"), "the sidecar must not be privileged")
    p.check(sc.get("allowPrivilegeEscalation") is False and sc.get("readOnlyRootFilesystem") is True,
            "the sidecar runs without privilege escalation on a read-only root filesystem")
    host_paths = {v["name"]: v["hostPath"]["path"] for v in spec.get("volumes", []) if "hostPath" in v}
    mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
    proc_vol = next((n for n, hp in host_paths.items() if hp == "/proc"), None)
    if p.check(proc_vol is not None, "the sidecar needs the host's /proc (process → pod attribution)"):
        mount = mounts.get(proc_vol, {})
        p.check(mount.get("readOnly") is True, "the host's /proc must be mounted read-only")
        p.check(f"--proc-root={mount.get('mountPath')}" in args, "--proc-root must point at the mounted host /proc")
    p.check(set(host_paths.values()) <= {"/proc"}, f"hostPath volumes beyond /proc: {sorted(host_paths.values())}")
    caps = sc.get("capabilities", {})
    p.check(caps.get("drop") == ["ALL"], "the sidecar drops every capability")
    want_caps = ["SYS_PTRACE", "DAC_READ_SEARCH"] if r.merged["sidecar"]["readOtherUsersProcesses"] else []
    mig_monitoring = r.merged["sidecar"]["migMonitoring"]
    if mig_monitoring:
        want_caps = want_caps + ["SYS_ADMIN"]
    p.check(sorted(caps.get("add") or []) == sorted(want_caps),
            f"the sidecar adds exactly {want_caps} (sidecar.readOtherUsersProcesses, sidecar.migMonitoring), got {caps.get('add')}")
    # MIG monitoring: the toolkit's NVIDIA_MIG_MONITOR_DEVICES only with
    # CAP_SYS_ADMIN (it refuses the one without the other), and only opted in.
    mig_env = [e.get("value") for e in c.get("env", []) if e.get("name") == "NVIDIA_MIG_MONITOR_DEVICES"]
    p.check(mig_env == (["all"] if mig_monitoring else []),
            f"NVIDIA_MIG_MONITOR_DEVICES=all exactly when sidecar.migMonitoring, got {mig_env}")
    p.check(spec.get("automountServiceAccountToken") is False, "the sidecar needs no API token")
    http = next((pt for pt in c.get("ports", []) if pt.get("name") == "http"), {})
    dep = r.one("Deployment")
    sidecar_urls = [a.split("=", 1)[1] for a in (container(dep, "controller").get("args", []) if dep else []) if a.startswith("--sidecar-url=")]
    if r.merged["sidecar"]["hostPort"]:
        p.check(http.get("hostPort") == http.get("containerPort"), "sidecar.hostPort: the http port must be open on the node's IP")
        if dep:
            p.check(sidecar_urls == [f"http://{{host_ip}}:{http.get('containerPort')}"],
                    f"the controller must reach each node's sidecar at http://{{host_ip}}:{http.get('containerPort')} (got {sidecar_urls})")
    else:
        p.check("hostPort" not in http and not sidecar_urls, "sidecar.hostPort=false: no hostPort and no --sidecar-url")
    svc = r.one("Service", "-sidecar")
    if p.check(svc is not None, "the sidecar needs a Service (metrics scraping)"):
        check_service_targets(svc, ds, p)


def check_service_monitors(r: Rendered, p: Problems) -> None:
    services = r.of("Service")
    for sm in r.of("ServiceMonitor"):
        name = f"ServiceMonitor/{sm['metadata']['name']}"
        p.check(sm["apiVersion"] == "monitoring.coreos.com/v1", f"{name}: apiVersion must be monitoring.coreos.com/v1")
        spec = sm["spec"]
        sel = spec.get("selector", {}).get("matchLabels", {})
        matched = [s for s in services if sel and sel.items() <= (s["metadata"].get("labels") or {}).items()]
        if not p.check(len(matched) == 1, f"{name}: selector {sel} must match exactly one Service (matched {len(matched)})"):
            continue
        port_names = {pt["name"] for pt in matched[0]["spec"]["ports"]}
        for ep in spec.get("endpoints", []):
            p.check(ep.get("port") in port_names, f"{name}: endpoint port {ep.get('port')!r} is not a port of {matched[0]['metadata']['name']}")
            p.check(ep.get("path") == "/metrics", f"{name}: endpoint path must be /metrics")
            p.check(isinstance(ep.get("interval"), str) and re.fullmatch(r"\d+[smh]", ep["interval"]) is not None,
                    f"{name}: interval must be a Prometheus duration")
        p.check(spec.get("namespaceSelector", {}).get("matchNames") == [NAMESPACE], f"{name}: namespaceSelector must be the release namespace")
        if matched[0]["metadata"]["labels"].get("app.kubernetes.io/component") == "sidecar":
            p.check(all(ep.get("honorLabels") is True for ep in spec.get("endpoints", [])),
                    f"{name}: honorLabels must be true, or the job metrics' namespace/pod labels become exported_namespace/exported_pod")


# ---------------------------------------------------------------- dashboards

# (what, predicate over all PromQL expressions of one panel)
REQUIRED_PANELS: list[tuple[str, Callable[[str, str], bool]]] = [
    ("GPU memory utilization by GPU model",
     lambda t, e: "gpufit_gpu_memory_used_bytes" in e and "gpufit_gpu_memory_total_bytes" in e and "by (model)" in e),
    ("GPU memory utilization by node",
     lambda t, e: "gpufit_gpu_memory_used_bytes" in e and "gpufit_gpu_memory_total_bytes" in e and "by (node)" in e),
    ("headroom left unused in GiB-hours",
     lambda t, e: "GiB-hours" in t and "sum_over_time" in e and "gpufit_gpu_memory_total_bytes" in e and "gpufit_gpu_memory_used_bytes" in e),
    ("OOMs", lambda t, e: "gpufit_controller_ooms_total" in e),
    ("prediction error quantiles",
     lambda t, e: "histogram_quantile" in e and "gpufit_controller_prediction_error" in e),
    ("suggestions by confidence", lambda t, e: "gpufit_controller_suggestion_confidence" in e),
    ("suggestions by source", lambda t, e: "gpufit_controller_suggestions_total" in e and "by (source)" in e),
]

GRAFANA_VARS = {
    "$__rate_interval": "5m",
    # Longest first: `$__interval_ms` contains `$__interval`.
    "$__interval_ms": "60000",
    "$__interval": "1m",
    "$__range": "1d",
    "${__range}": "1d",
}


def promql_of(expr: str) -> str:
    for k, v in GRAFANA_VARS.items():
        expr = expr.replace(k, v)
    # Template variables ($model, ${node}) become match-anything regexes.
    return re.sub(r"\$\{?[A-Za-z_]\w*\}?", ".*", expr)


def walk_panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from walk_panels(panel.get("panels", []))


def check_dashboards(files: dict[str, str], p: Problems, exprs_out: list[tuple[str, str]]) -> None:
    found_required = {what: False for what, _ in REQUIRED_PANELS}
    uids = set()
    for fname, text in sorted(files.items()):
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            p.add(f"dashboard {fname}: not valid JSON: {e}")
            continue
        for key in ("uid", "title", "panels", "schemaVersion", "templating"):
            p.check(key in d, f"dashboard {fname}: missing {key}")
        p.check(d.get("uid") not in uids, f"dashboard {fname}: uid {d.get('uid')} is not unique")
        uids.add(d.get("uid"))
        p.check(len(str(d.get("uid", ""))) <= 40, f"dashboard {fname}: uid longer than Grafana's 40 characters")
        ds_vars = [v for v in d.get("templating", {}).get("list", []) if v.get("type") == "datasource"]
        p.check(len(ds_vars) == 1 and ds_vars[0].get("query") == "prometheus",
                f"dashboard {fname}: needs one Prometheus datasource variable (no hard-coded datasource)")
        ds_name = ds_vars[0]["name"] if ds_vars else "datasource"
        ids = set()
        for panel in walk_panels(d.get("panels", [])):
            if panel.get("type") == "row":
                continue
            title = panel.get("title", "")
            where = f"dashboard {fname}: panel {title!r}"
            p.check(panel.get("id") not in ids, f"{where}: duplicate id {panel.get('id')}")
            ids.add(panel.get("id"))
            gp = panel.get("gridPos", {})
            p.check(all(isinstance(gp.get(k), int) for k in "xywh") and gp.get("x", 0) + gp.get("w", 0) <= 24,
                    f"{where}: gridPos must fit Grafana's 24-column grid")
            p.check(panel.get("datasource", {}).get("uid") == f"${{{ds_name}}}", f"{where}: must use the ${{{ds_name}}} datasource variable")
            targets = panel.get("targets", [])
            p.check(bool(targets), f"{where}: no queries")
            exprs = [t.get("expr", "") for t in targets]
            p.check(all(exprs), f"{where}: a query has no expr")
            for e in exprs:
                exprs_out.append((f"{fname} / {title}", e))
            joined = "\n".join(exprs)
            for what, pred in REQUIRED_PANELS:
                if pred(title, joined):
                    found_required[what] = True
    for what, ok in found_required.items():
        p.check(ok, f"dashboards: no panel shows {what}")


def check_promql(exprs: list[tuple[str, str]], p: Problems) -> None:
    """Every dashboard query must parse: promtool checks them as recording rules."""
    promtool = shutil.which("promtool")
    if not p.check(promtool is not None,
                   "promtool not found: it checks the dashboards' PromQL. Install it "
                   "(Debian: apt-get install -y prometheus, which ships /usr/bin/promtool)"):
        return
    rules = [{"record": f"gpufit:dashboard_check:{i}", "expr": promql_of(e)} for i, (_, e) in enumerate(exprs)]
    with tempfile.TemporaryDirectory(prefix="gpufit-helm-check-") as tmp:
        path = Path(tmp) / "rules.yaml"
        path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
        try:
            out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            p.add("promtool check rules took longer than 60 s")
            return
    if out.returncode != 0:
        text = out.stdout + out.stderr
        for i, (where, e) in enumerate(exprs):
            if f"dashboard_check:{i}\"" in text:
                p.add(f"{where}: PromQL does not parse: {e}")
        p.add(f"promtool rejected the dashboards' PromQL:\n{text.strip()}")


def check_dashboard_configmaps(r: Rendered, files: dict[str, str], p: Problems) -> None:
    d = r.merged["dashboards"]
    cms = [c for c in r.of("ConfigMap") if (c["metadata"].get("labels") or {}).get(d["label"]) == d["labelValue"]]
    if not d["enabled"]:
        p.check(not cms, "dashboards disabled but dashboard ConfigMaps rendered")
        return
    shipped: dict[str, str] = {}
    for cm in cms:
        for k, v in (cm.get("data") or {}).items():
            shipped[k] = v
    p.check(set(shipped) == set(files), f"dashboard ConfigMaps carry {sorted(shipped)}, the chart has {sorted(files)}")
    for k, v in shipped.items():
        if k in files:
            p.check(json.loads(v) == json.loads(files[k]), f"ConfigMap copy of {k} differs from dashboards/{k}")


# ---------------------------------------------------------------- CRD schema vs examples


def structural_to_jsonschema(node: Any) -> Any:
    """A CRD's OpenAPI v3 structural schema as JSON Schema, as the API server
    applies it with strict field validation (kubectl's default): `nullable`
    admits null, unknown fields are rejected unless
    x-kubernetes-preserve-unknown-fields, int-or-string admits both."""
    if isinstance(node, list):
        return [structural_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: structural_to_jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("type") == "object" and "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields") \
            and "additionalProperties" not in node:
        out["additionalProperties"] = False
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if node.get("nullable") and "enum" in out:
        out["enum"] = list(out["enum"]) + [None]
    return out


def check_examples_against_crd(crd: dict, p: Problems) -> int:
    """Every TrainingJob under examples/ must be accepted by the chart's CRD."""
    import jsonschema

    versions = {v["name"]: v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v.get("served")}
    count = 0
    for path in sorted((ROOT / "examples").rglob("*.y*ml")) if (ROOT / "examples").is_dir() else []:
        try:
            docs = [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
        except yaml.YAMLError as e:
            p.add(f"{path.relative_to(ROOT)}: not valid YAML: {e}")
            continue
        for d in docs:
            if d.get("kind") != "TrainingJob":
                continue
            group, _, version = str(d.get("apiVersion", "")).partition("/")
            if not p.check(group == "gpufit.io" and version in versions,
                           f"{path.relative_to(ROOT)}: apiVersion {d.get('apiVersion')} is not served by the CRD"):
                continue
            schema = structural_to_jsonschema(versions[version])
            # metadata is validated by the API server itself, not the CRD schema.
            schema.setdefault("properties", {})["metadata"] = {"type": "object"}
            schema["properties"]["apiVersion"] = {"type": "string"}
            schema["properties"]["kind"] = {"type": "string"}
            errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(d), key=lambda e: list(e.path))
            for e in errors[:5]:
                where = ".".join(str(x) for x in e.path) or "<root>"
                p.add(f"{path.relative_to(ROOT)}: TrainingJob {d.get('metadata', {}).get('name')} rejected by the CRD at {where}: {e.message}")
            count += 1
    return count


# ---------------------------------------------------------------- values schema


def check_values_schema(values: dict, schema: dict | None, p: Problems, path: str = "") -> None:
    """Every key of values.yaml is declared in values.schema.json (so the two stay in step)."""
    if not p.check(schema is not None, "values.schema.json is missing"):
        return
    props = schema.get("properties")
    if props is None:
        return  # a free-form map (labels, resources, affinity …)
    for key, val in values.items():
        where = f"{path}.{key}" if path else key
        if p.check(key in props, f"values.yaml: {where} is not declared in values.schema.json"):
            if isinstance(val, dict):
                check_values_schema(val, props[key], p, where)


# ---------------------------------------------------------------- main


def command_lines(r: Rendered) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, cname in (("Deployment", "controller"), ("DaemonSet", "sidecar")):
        w = r.one(kind)
        if w is None:
            continue
        c = container(w, cname)
        out[cname] = {
            "command": c.get("command", []) + c.get("args", []),
            "env": sorted(e["name"] for e in c.get("env", []) if e["name"].startswith("GPUFIT_")),
        }
    return out


def run(dump_args: Path | None) -> int:
    problems = Problems()
    examples = 0
    dumped: dict[str, Any] = {}
    dashboards = {f.name: f.read_text() for f in sorted((CHART / "dashboards").glob("*.json"))}

    with helm.Chart.load(str(CHART)) as chart:
        # The CRDs under crds/ are not templates: validate them on their own.
        problems.context = "crds"
        crds = chart.crds
        problems.check(len(crds) >= 1, "charts/gpufit/crds/ holds no CRD")
        for crd in crds:
            for doc in yaml.safe_load_all(crd["data"]):
                if doc is None:
                    continue
                doc = {**doc, "__source__": f"crds/{crd['name']}"}
                validate_schema(doc, problems)
                problems.check(doc.get("kind") == "CustomResourceDefinition", f"crds/{crd['name']}: not a CRD")
                if doc.get("metadata", {}).get("name") == "trainingjobs.gpufit.io":
                    spec = doc["spec"]
                    problems.check(spec["group"] == "gpufit.io" and spec["scope"] == "Namespaced", "TrainingJob CRD: group gpufit.io, namespaced")
                    problems.check("tj" in spec["names"].get("shortNames", []), "TrainingJob CRD: short name tj")
                    served = [v["name"] for v in spec["versions"] if v.get("served")]
                    problems.check("v1alpha1" in served, "TrainingJob CRD must serve v1alpha1")
                    for v in spec["versions"]:
                        problems.check("status" in v.get("subresources", {}), f"TrainingJob {v['name']}: status subresource")
                    examples = check_examples_against_crd(doc, problems)

        problems.context = "values.schema.json"
        check_values_schema(chart.values, chart.schema, problems)

        problems.context = "dashboards"
        exprs: list[tuple[str, str]] = []
        check_dashboards(dashboards, problems, exprs)
        check_promql(exprs, problems)

        for case in CASES:
            problems.context = case.name
            try:
                merged = chart.merge_values(case.values)
                chart.validate_schema(case.values)
                rendered = chart.render(case.values, name=RELEASE, namespace=NAMESPACE)
            except helm.HelmError as e:
                problems.add(f"render failed: {e}")
                continue
            lint = helm.lint(str(CHART), case.values, strict=True, namespace=NAMESPACE)
            for err in lint.get("errors") or []:
                problems.add(f"helm lint: {err}")
            for m in lint.get("messages") or []:
                if m.get("severity", 0) >= 2:
                    problems.add(f"helm lint: {m.get('path')}: {m.get('error')}")
            docs = parse_manifests(rendered, problems)
            r = Rendered(case.values, merged, docs)
            for d in docs:
                validate_schema(d, problems)
            seen = set()
            for d in docs:
                key = (d.get("kind"), d.get("metadata", {}).get("namespace"), d.get("metadata", {}).get("name"))
                problems.check(key not in seen, f"{key[0]}/{key[2]} rendered twice")
                seen.add(key)
            for check in (check_rbac, check_webhook, check_controller, check_sidecar, check_service_monitors):
                try:
                    check(r, problems)
                except (KeyError, TypeError, IndexError, AttributeError) as e:
                    problems.add(f"{check.__name__}: a manifest lacks an expected field: {type(e).__name__}: {e}")
            check_dashboard_configmaps(r, dashboards, problems)
            if case.expect:
                try:
                    case.expect(r, problems)
                except (KeyError, TypeError, IndexError, AttributeError) as e:
                    problems.add(f"case expectations: a manifest lacks an expected field: {type(e).__name__}: {e}")
            dumped[case.name] = command_lines(r)

        for bad in FAILING:
            problems.context = f"must fail: {bad.name}"
            try:
                chart.render(bad.values, name=RELEASE, namespace=NAMESPACE)
                problems.add(f"rendered although it should be refused (expected a message containing {bad.needle!r})")
            except helm.HelmError as e:
                problems.check(bad.needle in str(e), f"refused, but the message does not say {bad.needle!r}: {e}")

    problems.context = ""
    if dump_args is not None:
        dump_args.write_text(json.dumps(dumped, indent=2))
    if problems.items:
        print(f"helm_check: {len(problems.items)} problem(s):", file=sys.stderr)
        for item in problems.items:
            print(f"  - {item}", file=sys.stderr)
        return 1
    print(
        f"helm_check: ok — {len(CASES)} value sets rendered, linted and validated "
        f"(Kubernetes {', '.join(KUBE_VERSIONS)}), {len(FAILING)} bad value sets refused, "
        f"{len(dashboards)} dashboards / {len(exprs)} PromQL queries checked, "
        f"{examples} example TrainingJobs checked against the CRD"
    )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump-args", type=Path, help="write each case's command lines and GPUFIT_* env names as JSON")
    ap.add_argument("--chart", type=Path, help="check this chart directory instead of charts/gpufit")
    a = ap.parse_args()
    os.chdir(ROOT)
    if a.chart is not None:
        global CHART
        CHART = a.chart.resolve()
    return run(a.dump_args)


if __name__ == "__main__":
    sys.exit(main())
