"""Triton model deployments on a tenant's slice: validate and store (web), then on the node's worker
write the slice's model repository, load through Triton (explicit model control), check readiness;
unload and remove on request or when the slice is released."""

from __future__ import annotations

import logging
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.db.models import Sum
from django.utils import timezone
from tritonclient.utils import InferenceServerException

from marketplace.hardware import triton
from marketplace.models import Allocation, ModelDeployment
from marketplace.models.deployments import LIVE_DEPLOYMENT_STATES
from marketplace.selectors.catalog import modelled_tokens_per_s
from tenants.errors import Conflict, Forbidden, ServiceError
from tenants.scoping import Principal

log = logging.getLogger("tessera.deployments")
D = ModelDeployment.State
MAX_FILES_BYTES = 2 * 1024 * 1024

TEMPLATES = {"tiny-gen": triton.demo_text_model}


def slice_memory_mb(allocation: Allocation) -> int:
    tier = allocation.tier
    return tier.profile.memory_mib if tier.profile_id else tier.gpu_model.memory_mib


def repo_dir(allocation: Allocation) -> Path:
    return Path(settings.TESSERA_TRITON_REPO_ROOT) / f"allocation-{allocation.pk}"


def backend_for(allocation: Allocation) -> triton.TritonBackend:
    """The slice's Triton server: simulated over the slice's repository, or the real one's URL."""
    if settings.TESSERA_TRITON_BACKEND == "http":
        if not allocation.triton_url:
            raise RuntimeError(f"allocation {allocation.pk} has no Triton server URL yet")
        return triton.get_triton_backend("http", url=allocation.triton_url,
                                         metrics_url=allocation.triton_metrics_url or None)
    tier = allocation.tier
    rate = modelled_tokens_per_s(tier.gpu_model, tier.profile if tier.profile_id else None)
    return triton.get_triton_backend("sim", repo_dir=repo_dir(allocation), memory_mb=slice_memory_mb(allocation),
                                     tokens_per_s=rate)


def build_spec(name: str, *, template: str | None = None, spec: dict | None = None) -> triton.ModelSpec:
    """A ModelSpec from a template name or a full spec; ValueError -> a 400 naming the problem."""
    try:
        if template:
            if template not in TEMPLATES:
                raise ServiceError(f"unknown template; choose one of {', '.join(TEMPLATES)}", field="template")
            extra = {k: v for k, v in (spec or {}).items() if k in {"memory_mb", "instance_count", "max_batch_size"}}
            return TEMPLATES[template](name, **extra)
        if not spec:
            raise ServiceError("give a template or a spec", field="spec")
        size = sum(len(v.encode() if isinstance(v, str) else v) for v in (spec.get("files") or {}).values())
        if size > MAX_FILES_BYTES:
            raise ServiceError(f"model files are {size} bytes; the limit is {MAX_FILES_BYTES}", field="spec")
        return triton.ModelSpec(name=name, **{k: v for k, v in spec.items() if k != "name"})
    except (ValueError, TypeError) as exc:
        raise ServiceError(str(exc), field="spec") from None


def spec_to_json(spec: triton.ModelSpec) -> dict:
    from dataclasses import asdict  # noqa: PLC0415

    data = asdict(spec)
    data["files"] = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in spec.files.items()}
    return data


def deploy(principal: Principal, allocation: Allocation, name: str, *, template: str | None = None,
           spec: dict | None = None) -> ModelDeployment:
    if not principal.can("deploy", allocation.tenant_id):
        raise Forbidden("Your role or API-key scopes do not allow deploying to this slice.")
    model = build_spec(name, template=template, spec=spec)
    with transaction.atomic():
        allocation = Allocation.objects.select_for_update(of=("self",)).select_related(
            "tier__profile", "tier__gpu_model", "node").get(pk=allocation.pk)
        if allocation.state != Allocation.State.ACTIVE:
            raise Conflict(f"models are deployed to active slices; this one is {allocation.state}",
                           field="allocation")
        live = ModelDeployment.objects.filter(allocation=allocation, state__in=LIVE_DEPLOYMENT_STATES)
        if live.filter(name=name).exists():
            raise Conflict(f"a model named {name} is already deployed on this slice", field="name")
        used = live.exclude(state=D.FAILED).aggregate(m=Sum("memory_mb"))["m"] or 0
        capacity = slice_memory_mb(allocation)
        if model.memory_mb <= 0:
            raise ServiceError("declare the model's memory need (memory_mb > 0)", field="spec")
        if used + model.memory_mb > capacity:
            raise ServiceError(f"{model.memory_mb} MiB does not fit: {used} of {capacity} MiB on this "
                               f"{allocation.tier.name} slice are taken", field="spec")
        dep = ModelDeployment.objects.create(
            allocation=allocation, tenant_id=allocation.tenant_id, name=name, backend=model.backend,
            spec=spec_to_json(model), memory_mb=model.memory_mb, created_by=principal.user,
        )
        transaction.on_commit(lambda: _enqueue("deploy_model", dep, allocation))
    return dep


def remove(principal: Principal, dep: ModelDeployment) -> ModelDeployment:
    if not principal.can("deploy", dep.tenant_id):
        raise Forbidden("Your role or API-key scopes do not allow removing this model.")
    with transaction.atomic():
        dep = ModelDeployment.objects.select_for_update(of=("self",)).select_related("allocation__node").get(pk=dep.pk)
        if dep.state in (D.REMOVED, D.UNLOADING):
            raise Conflict(f"this model is already {dep.state}")
        _set(dep, D.UNLOADING)
        transaction.on_commit(lambda: _enqueue("undeploy_model", dep, dep.allocation))
    return dep


def _enqueue(task_name: str, dep: ModelDeployment, allocation: Allocation) -> None:
    from marketplace import tasks  # noqa: PLC0415

    getattr(tasks, task_name).apply_async(args=[dep.pk], queue=allocation.node.queue)


def _set(dep: ModelDeployment, state: str, reason: str = "") -> None:
    now = timezone.now()
    fields = {"state": state, "updated_at": now, "failure_reason": reason[:1000]}
    if state == D.READY:
        fields["ready_at"] = now
    ModelDeployment.objects.filter(pk=dep.pk).update(**fields)
    for k, v in fields.items():
        setattr(dep, k, v)


def spec_from_json(data: dict) -> triton.ModelSpec:
    return triton.ModelSpec(**data)


# --- node side (Celery tasks on the node's queue) ----------------------------------------------

def load(deployment_id: int) -> str:
    dep = ModelDeployment.objects.select_related("allocation__tier__profile", "allocation__tier__gpu_model").get(
        pk=deployment_id)
    if dep.state in (D.READY, D.UNLOADING, D.REMOVED):
        return f"nothing to do ({dep.state})"
    allocation = dep.allocation
    spec = spec_from_json(dep.spec)
    triton.write_repository(repo_dir(allocation), spec)  # idempotent: same spec, same bytes
    _set(dep, D.LOADING)
    server = backend_for(allocation)
    try:
        server.load_model(dep.name)
        ready = server.is_model_ready(dep.name)
    except InferenceServerException as exc:
        _set(dep, D.FAILED, f"Triton refused the model: {exc}")
        return "failed"
    if not ready:
        _set(dep, D.FAILED, "Triton loaded the model but does not report it ready")
        return "failed"
    _set(dep, D.READY)
    log.info("model ready", extra={"deployment": dep.pk, "model": dep.name, "allocation": allocation.pk})
    return "ready"


def unload(deployment_id: int) -> str:
    dep = ModelDeployment.objects.select_related("allocation__tier__profile", "allocation__tier__gpu_model").get(
        pk=deployment_id)
    if dep.state == D.REMOVED:
        return "already removed"
    allocation = dep.allocation
    _final_scrape(dep)
    try:
        backend_for(allocation).unload_model(dep.name)  # unloading an unloaded model is a no-op
    except InferenceServerException as exc:
        log.warning("unload failed; removing the files anyway", extra={"deployment": dep.pk, "err": str(exc)})
    triton.remove_model(repo_dir(allocation), dep.name)
    _set(dep, D.REMOVED)
    return "removed"


def _final_scrape(dep: ModelDeployment) -> None:
    """What the model served since the last scrape, counted before unloading takes its statistics away."""
    from telemetry.services import scrape  # noqa: PLC0415 - telemetry builds on this module

    try:
        with backend_for(dep.allocation) as server:
            if server.is_model_ready(dep.name):
                scrape.record_counters(dep, scrape.reader(server, dep.name))
    except Exception as exc:  # noqa: BLE001 - the unload goes on; the lost count is logged
        log.warning("final Triton scrape before unload failed", extra={"deployment": dep.pk, "err": str(exc)})


def prepare_slice(allocation: Allocation) -> None:
    """The ready step: the slice's model repository exists and its Triton server answers."""
    repo_dir(allocation).mkdir(parents=True, exist_ok=True)
    if settings.TESSERA_TRITON_BACKEND == "http" and not allocation.triton_url:
        return  # the node agent starts the slice's server and records its URL
    if not backend_for(allocation).is_server_ready():
        raise RuntimeError("the slice's Triton server is not ready")


def unload_all(allocation: Allocation) -> int:
    """Before a slice is destroyed: its models go first (NVML refuses to destroy a busy slice)."""
    n = 0
    for dep in ModelDeployment.objects.filter(allocation=allocation).exclude(state=D.REMOVED):
        unload(dep.pk)
        n += 1
    return n
