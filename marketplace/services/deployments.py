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

from marketplace import enqueue, fit
from marketplace.hardware import model_repo, triton
from marketplace.models import Allocation, ModelDeployment, TritonServer
from marketplace.models.deployments import LIVE_DEPLOYMENT_STATES
from marketplace.services import serving
from marketplace.services.models import TENSORRTLLM_SAMPLING
from tenants.errors import Conflict, Forbidden, ServiceError
from tenants.scoping import Principal

log = logging.getLogger("tessera.deployments")
MAX_FILES_BYTES = 2 * 1024 * 1024

TEMPLATES = {"tiny-gen": triton.demo_text_model, "tiny-chat": triton.demo_chat_model}


slice_memory_mb = serving.slice_memory_mb


# Backends whose models run as processes on the host (not in GPU memory): their declared memory counts against
# the slice's host-memory allowance (Tier.host_memory_allowance_mib), the limit of its sandbox's cgroup.
HOST_MEMORY_BACKENDS = ("python",)


class WaitingForServer(Exception):
    """The slice's server is not up yet: the deploy task tries again shortly (until TESSERA_DEPLOY_WAIT_S)."""


def repo_dir(allocation: Allocation) -> Path:
    return serving.repo_dir(allocation.pk)


def backend_for(allocation: Allocation) -> triton.TritonBackend:
    """The slice's Triton server (simulated or real), with its repository-API secret; raises
    ``serving.ServerNotUp`` when the slice has no running server."""
    return serving.client_for(allocation)


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
    from dataclasses import asdict

    data = asdict(spec)
    data["files"] = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in spec.files.items()}
    return data


def _source(name: str, *, template, spec, repository, model, library_model, context, concurrency, memory_mb,
            allocation: Allocation, adapters=()):
    """What a deployment writes to the slice and how much memory it takes: (stored spec, backend, fit shape,
    context, concurrency, name). Templates and full specs declare their memory (runtime included); an
    uploaded repository takes its declared memory or its files' size plus its backend's overhead; a library
    model its weights, KV cache for context x concurrency and its backend's overhead (marketplace.fit)."""
    from marketplace.services import models as model_svc

    if repository is not None:
        top, names = model_svc.pick_model(repository, model)
        if name and name != top["name"]:
            raise ServiceError(f"a model keeps its repository name: {top['name']}", field="name")
        shape = model_svc.repository_shape(repository, names, memory_mb)
        stored = {"kind": "upload", "repository": repository.pk, "path": repository.path, "models": names,
                  "model": top["name"], "memory_mb": shape.fixed_mib + fit.overhead_mib(shape.backend),
                  # what the gateway needs to serve it: its tensors and whether it streams
                  "inputs": top.get("inputs", []), "outputs": top.get("outputs", []),
                  "decoupled": bool(top.get("decoupled"))}
        backends = {m["backend"] for m in repository.manifest if m["name"] in names}
        return stored, top["backend"], backends, shape, 0, 1, top["name"]
    if library_model is not None:
        if not library_model.active:
            raise ServiceError(f"{library_model.name} is no longer offered", field="library_model")
        for a in adapters:
            if a.tenant_id != allocation.tenant_id:
                raise ServiceError("the adapter belongs to another tenant", field="adapters")
            if a.base_id != library_model.pk:
                raise ServiceError(f"adapter {a.name} was trained for another base model", field="adapters")
        shape = model_svc.library_shape(library_model, tuple(model_svc.adapter_mib(a) for a in adapters))
        if context and context > library_model.max_context:
            raise ServiceError(f"context {context:,} exceeds {library_model.name}'s max context of "
                               f"{library_model.max_context:,} tokens", field="context")
        return ({"kind": "library", "library_model": library_model.key, **LIBRARY_IO.get(library_model.backend, {})},
                library_model.backend,
                {library_model.backend}, shape, context, concurrency, name)
    model_spec = build_spec(name, template=template, spec=spec)
    if model_spec.memory_mb <= 0:
        raise ServiceError("declare the model's memory need (memory_mb > 0)", field="spec")
    shape = fit.ModelShape(name=name, backend=model_spec.backend, fixed_mib=model_spec.memory_mb,
                           overhead_included=True)
    return spec_to_json(model_spec), model_spec.backend, {model_spec.backend}, shape, 0, 1, name


# The tensors of the repositories Tessera writes for library models, as the gateway calls them: vLLM's backend
# takes text_input, sampling_parameters (a JSON string) and stream, and answers text_output, decoupled; the
# TensorRT-LLM ensemble takes text_input, max_tokens and its optional sampling inputs, and answers text_output.
LIBRARY_IO = {
    "vllm": {"inputs": [{"name": "text_input"}, {"name": "sampling_parameters"}, {"name": "stream"}],
             "outputs": [{"name": "text_output"}], "decoupled": True},
    "tensorrtllm": {"inputs": [{"name": "text_input", "data_type": "TYPE_STRING"},
                               {"name": "max_tokens", "data_type": "TYPE_INT32"},
                               *({"name": name, "data_type": dtype} for name, _, dtype in TENSORRTLLM_SAMPLING)],
                    "outputs": [{"name": "text_output"}], "decoupled": False},
}


def deploy(principal: Principal, allocation: Allocation, name: str, *, template: str | None = None,
           spec: dict | None = None, repository=None, model: str | None = None, library_model=None,
           context: int = 0, concurrency: int = 1, memory_mb: int = 0, adapters=None) -> ModelDeployment:
    """Deploy a template, a full spec, a model of the tenant's own repository or a library model to an active
    slice. Refused (400, with the numbers) when it does not fit next to the models already there."""
    if not principal.can("deploy", allocation.tenant_id):
        raise Forbidden("Your role or API-key scopes do not allow deploying to this slice.")
    if repository is not None and repository.tenant_id != allocation.tenant_id:
        raise ServiceError("the repository belongs to another tenant", field="repository")
    from marketplace.services import models as model_svc

    if repository is not None:
        model_svc.require_ready(repository, "repository")  # 409 while it is validating or when it failed
    for a in adapters or ():
        model_svc.require_ready(a, "adapters")
    if concurrency < 1:
        raise ServiceError("concurrency must be at least 1", field="concurrency")
    adapters = list(adapters or ())
    if adapters and library_model is None:
        raise ServiceError("LoRA adapters are deployed with their library base model", field="adapters")
    stored, backend, backends, shape, context, concurrency, name = _source(
        name, template=template, spec=spec, repository=repository, model=model, library_model=library_model,
        context=context, concurrency=concurrency, memory_mb=memory_mb, allocation=allocation, adapters=adapters)
    with transaction.atomic():
        allocation = Allocation.objects.select_for_update(of=("self",)).select_related(
            "tier__profile", "tier__gpu_model", "node").get(pk=allocation.pk)
        if allocation.state != Allocation.State.ACTIVE:
            raise Conflict(f"models are deployed to active slices; this one is {allocation.state}",
                           field="allocation")
        tier = allocation.tier
        refused = sorted(b for b in backends if b not in tier.backends)
        if refused:
            raise ServiceError(f"backend {', '.join(refused)} is not offered on {tier.name} (allowed: "
                               f"{', '.join(tier.backends)})", field="spec" if repository is None else "repository")
        live = ModelDeployment.objects.filter(allocation=allocation, state__in=LIVE_DEPLOYMENT_STATES)
        if live.filter(name=name).exists():
            raise Conflict(f"a model named {name} is already deployed on this slice", field="name")
        used = live.exclude(state=ModelDeployment.State.FAILED).aggregate(m=Sum("memory_mb"))["m"] or 0
        capacity = slice_memory_mb(allocation)
        if library_model is not None and not context:  # the longest context that fits for this concurrency
            probe = fit.fit(shape, capacity, context=1, concurrency=concurrency, other_mib=used,
                            tensor_parallel=tier.gpu_count)
            context = probe.max_context if probe.max_context > 0 else library_model.max_context
        result = fit.fit(shape, capacity, context=context, concurrency=concurrency, other_mib=used,
                         tensor_parallel=tier.gpu_count)  # a multi-GPU tier: per GPU, split over its GPUs
        if not result.fits:
            field = "context" if library_model is not None and result.max_cached_tokens else "spec"
            raise ServiceError(f"{result.reason} ({used:,} of {capacity:,} MiB on this {tier.name} slice are "
                               "taken by other models)", field=field, code="does_not_fit")
        if backend in HOST_MEMORY_BACKENDS:  # runs in the slice's sandbox on the host: its memory limit
            host_used = live.exclude(state=ModelDeployment.State.FAILED).filter(
                backend__in=HOST_MEMORY_BACKENDS).aggregate(m=Sum("memory_mb"))["m"] or 0
            allowance = tier.host_memory_allowance_mib
            if host_used + result.needed_mib > allowance:
                raise ServiceError(f"{name} declares {result.needed_mib:,} MiB of host memory; this {tier.name} "
                                   f"slice's sandbox allows {allowance:,} MiB and {host_used:,} are declared by its "
                                   f"other models", field="spec" if repository is None else "memory_mb",
                                   code="does_not_fit")
        if stored.get("kind") == "library":
            from marketplace.services import models as model_svc

            files = model_svc.library_files(name, library_model, result, concurrency=concurrency,
                                            adapters=adapters)
            stored.update(files=files, models=model_svc.model_names(files), model=name,
                          memory_mb=result.needed_mib, fit=result.as_dict(),
                          copy=model_svc.tensorrtllm_copies(name, library_model)
                          if library_model.backend == "tensorrtllm" else {},
                          adapters=[{"id": a.pk, "name": a.name, "rank": a.rank,
                                     "memory_mb": model_svc.adapter_mib(a)} for a in adapters],
                          adapter_dirs=model_svc.adapter_dirs(name, adapters))
        dep = ModelDeployment.objects.create(
            allocation=allocation, tenant_id=allocation.tenant_id, name=name, backend=backend,
            spec=stored, memory_mb=result.needed_mib, created_by=principal.user, repository=repository,
            library_model=library_model, context=context, concurrency=concurrency,
        )
        if adapters:
            dep.adapters.set(adapters)
        transaction.on_commit(lambda: _enqueue(enqueue.DEPLOY_MODEL, dep, allocation))
    return dep


def remove(principal: Principal, dep: ModelDeployment) -> ModelDeployment:
    if not principal.can("deploy", dep.tenant_id):
        raise Forbidden("Your role or API-key scopes do not allow removing this model.")
    with transaction.atomic():
        dep = ModelDeployment.objects.select_for_update(of=("self",)).select_related("allocation__node").get(pk=dep.pk)
        if dep.state in (ModelDeployment.State.REMOVED, ModelDeployment.State.UNLOADING):
            raise Conflict(f"this model is already {dep.state}")
        _set(dep, ModelDeployment.State.UNLOADING)
        transaction.on_commit(lambda: _enqueue(enqueue.UNDEPLOY_MODEL, dep, dep.allocation))
    return dep


def _enqueue(task_name: str, dep: ModelDeployment, allocation: Allocation) -> None:
    """Queue a deployment task (an enqueue.* task name) on the allocation's node."""
    node = allocation.node
    if node is None:  # never: models are deployed only on placed allocations, whose node is kept
        raise ValueError(f"allocation {allocation.pk} has no node to queue {task_name} on")
    enqueue.send(task_name, [dep.pk], node.queue)


def tenant_safe(reason: str, allocation_id: int) -> str:
    """A failure reason as the tenant may read it: the slice's repository, the upload root and the model store
    become model-relative paths, any other path of the node ``<node path>`` (Triton's load errors name files
    with the server's absolute paths)."""
    from marketplace.services import models as model_svc

    return model_repo.scrub_paths(reason, {str(serving.repo_dir(allocation_id)): "", **model_svc.node_roots()})


def _set(dep: ModelDeployment, state: str, reason: str = "") -> None:
    now = timezone.now()
    fields = {"state": state, "updated_at": now, "failure_reason": tenant_safe(reason, dep.allocation_id)[:1000]}
    if state != ModelDeployment.State.PENDING:  # no longer waiting for the slice's server
        fields.update(waiting_reason="", waiting_since=None)
    if state == ModelDeployment.State.READY:
        fields["ready_at"] = now
    ModelDeployment.objects.filter(pk=dep.pk).update(**fields)
    for k, v in fields.items():
        setattr(dep, k, v)


def fail(dep: ModelDeployment, reason: str) -> None:
    """A ready model stopped by the node (its sandbox's limits): failed, with the reason its tenant sees; the
    tenant retries it once fixed."""
    _set(dep, ModelDeployment.State.FAILED, reason)


def spec_from_json(data: dict) -> triton.ModelSpec:
    return triton.ModelSpec(**data)


def model_folders(dep: ModelDeployment) -> list[str]:
    """The model folders a deployment owns in its slice's repository (an ensemble's steps included)."""
    return list(dep.spec.get("models") or [dep.name]) if dep.spec.get("kind") else [dep.name]


def write_model(dep: ModelDeployment, repo: Path) -> None:
    """Write a deployment's model folder(s) into the slice's repository (node side)."""
    kind = dep.spec.get("kind")
    if kind == "upload":
        from marketplace.services import models as model_svc

        model_repo.copy_models(model_svc.upload_root() / dep.spec["path"], repo, dep.spec["models"])
    elif kind == "library":
        from marketplace.services import models as model_svc

        model_repo.write_files(repo, dep.spec["files"], copies=dep.spec.get("copy") or {},
                               copy_dirs={k: str(model_svc.upload_root() / v)
                                          for k, v in (dep.spec.get("adapter_dirs") or {}).items()})
    else:
        triton.write_repository(repo, spec_from_json(dep.spec))


# --- node side (Celery tasks on the node's queue) ----------------------------------------------

def _server_up(allocation: Allocation) -> bool:
    server = TritonServer.objects.filter(allocation=allocation).first()
    if server is None or server.state != TritonServer.State.RUNNING:
        return False
    try:
        with serving.client_for(allocation, server) as client:
            return client.is_server_ready()
    except serving.ServerNotUp:
        return False


def load(deployment_id: int) -> str:
    """Write the model's repository folder and load it. A slice whose server is not up (yet): the model
    waits with that reason (``WaitingForServer``: the task retries) and fails after TESSERA_DEPLOY_WAIT_S."""
    dep = ModelDeployment.objects.select_related(
        "allocation__tier__profile", "allocation__tier__gpu_model", "allocation__node").get(pk=deployment_id)
    done = (ModelDeployment.State.READY, ModelDeployment.State.UNLOADING, ModelDeployment.State.REMOVED,
            ModelDeployment.State.FAILED)
    if dep.state in done:
        return f"nothing to do ({dep.state})"
    allocation = dep.allocation
    if allocation.state != Allocation.State.ACTIVE or not _server_up(allocation):
        return _wait_for_server(dep, allocation)
    try:
        write_model(dep, repo_dir(allocation))  # idempotent: same spec, same bytes
    except (OSError, ValueError) as exc:
        _set(dep, ModelDeployment.State.FAILED, f"the model's files could not be written: {exc}")
        return "failed"
    serving.own_repository(allocation)
    _set(dep, ModelDeployment.State.LOADING)
    try:
        with backend_for(allocation) as server:
            server.load_model(dep.name)
            ready = server.is_model_ready(dep.name)
    except InferenceServerException as exc:
        _set(dep, ModelDeployment.State.FAILED, f"Triton refused the model: {exc}")
        return "failed"
    if not ready:
        _set(dep, ModelDeployment.State.FAILED, "Triton loaded the model but does not report it ready")
        return "failed"
    _set(dep, ModelDeployment.State.READY)
    log.info("model ready", extra={"deployment": dep.pk, "model": dep.name, "allocation": allocation.pk})
    return "ready"


def _wait_for_server(dep: ModelDeployment, allocation: Allocation) -> str:
    now = timezone.now()
    since = dep.waiting_since or now
    waited = (now - since).total_seconds()
    if waited >= settings.TESSERA_DEPLOY_WAIT_S or allocation.state in (
            Allocation.State.RELEASING, Allocation.State.RELEASED, Allocation.State.FAILED):
        why = (f"the slice is {allocation.state}" if allocation.state != Allocation.State.ACTIVE else
               f"the slice's inference server was not up within {settings.TESSERA_DEPLOY_WAIT_S:.0f} s")
        _set(dep, ModelDeployment.State.FAILED, f"{why}; retry the model when the slice is serving")
        return "failed"
    reason = "waiting for the slice's inference server to start"
    ModelDeployment.objects.filter(pk=dep.pk).update(waiting_reason=reason, waiting_since=since, updated_at=now)
    dep.waiting_reason, dep.waiting_since = reason, since
    raise WaitingForServer(f"deployment {dep.pk}: {reason} ({waited:.0f} s so far)")


def retry(principal: Principal, dep: ModelDeployment) -> ModelDeployment:
    """Try a failed model again (after its slice's server came back, or a fixed cause)."""
    if not principal.can("deploy", dep.tenant_id):
        raise Forbidden("Your role or API-key scopes do not allow deploying to this slice.")
    with transaction.atomic():
        dep = ModelDeployment.objects.select_for_update(of=("self",)).select_related("allocation__node").get(pk=dep.pk)
        if dep.state != ModelDeployment.State.FAILED:
            raise Conflict(f"only failed models are retried (this one is {dep.state})", field="state")
        if dep.allocation.state != Allocation.State.ACTIVE:
            raise Conflict(f"models are deployed to active slices; this one is {dep.allocation.state}",
                           field="allocation")
        ModelDeployment.objects.filter(pk=dep.pk).update(waiting_since=None, waiting_reason="")
        _set(dep, ModelDeployment.State.PENDING)
        dep.waiting_since, dep.waiting_reason = None, ""
        transaction.on_commit(lambda: _enqueue(enqueue.DEPLOY_MODEL, dep, dep.allocation))
    return dep


def unload(deployment_id: int) -> str:
    dep = ModelDeployment.objects.select_related(
        "allocation__tier__profile", "allocation__tier__gpu_model", "allocation__node").get(pk=deployment_id)
    if dep.state == ModelDeployment.State.REMOVED:
        return "already removed"
    allocation = dep.allocation
    if _server_up(allocation):
        _final_scrape(dep)
        try:
            with backend_for(allocation) as server:
                for folder in model_folders(dep):  # an ensemble's steps too
                    server.unload_model(folder)  # unloading an unloaded model is a no-op
        except InferenceServerException as exc:
            log.warning("unload failed; removing the files anyway", extra={"deployment": dep.pk, "err": str(exc)})
    for folder in model_folders(dep):
        triton.remove_model(repo_dir(allocation), folder)
    _set(dep, ModelDeployment.State.REMOVED)
    return "removed"


def _final_scrape(dep: ModelDeployment) -> None:
    """What the model served since the last scrape, counted before unloading takes its statistics away."""
    from telemetry.services import scrape  # telemetry builds on this module

    try:
        with backend_for(dep.allocation) as server:
            if server.is_model_ready(dep.name):
                scrape.record_counters(dep, scrape.reader(server, dep.name))
    except Exception as exc:  # the unload goes on; the lost count is logged
        log.warning("final Triton scrape before unload failed", extra={"deployment": dep.pk, "err": str(exc)})


def unload_all(allocation: Allocation) -> int:
    """Before a slice is destroyed: its models go first (NVML refuses to destroy a busy slice)."""
    n = 0
    for dep in ModelDeployment.objects.filter(allocation=allocation).exclude(state=ModelDeployment.State.REMOVED):
        unload(dep.pk)
        n += 1
    return n
