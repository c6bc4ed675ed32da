"""Offline validation of rendered manifests: the RBG CRD's openAPIV3Schema (jsonschema) and the core
Kubernetes schemas (kubernetes-validate, which ships them)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Optional

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = "workloads.x-k8s.io_rolebasedgroups.yaml"


def crd_dir() -> Optional[Path]:
    """../shared/rbg-crd beside the repository (where CI puts it), else $KVSTRATA_RBG_CRD_DIR."""
    for candidate in (REPO_ROOT.parent / "shared" / "rbg-crd", os.environ.get("KVSTRATA_RBG_CRD_DIR")):
        if candidate and (Path(candidate) / CRD_FILE).exists():
            return Path(candidate)
    return None


@functools.lru_cache(maxsize=4)
def crd_schema(version: str) -> dict:
    """The openAPIV3Schema of a served version of the RoleBasedGroup CRD, made strict (see `strict`)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)   # the C loader: the CRD is large
    crd = yaml.load((crd_dir() / CRD_FILE).read_text(), Loader=loader)
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            assert v["served"], f"{version} is not served"
            return strict(v["schema"]["openAPIV3Schema"])
    raise KeyError(version)


def strict(schema: Any) -> Any:
    """Reject unknown fields wherever the schema lists its properties, as the API server's strict field
    validation does (plain JSON schema would accept any extra key)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def validate_crd_object(obj: dict, version: str) -> None:
    """Raise jsonschema.ValidationError if `obj` does not fit the CRD's schema."""
    import jsonschema

    jsonschema.Draft7Validator(crd_schema(version)).validate(obj)


def validate_core(obj: dict) -> None:
    """Raise kubernetes_validate.ValidationError if a core object does not fit its schema (strict)."""
    import kubernetes_validate

    kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
