"""Models tenants run: their own Triton repositories (upload or model store) and the MSP's library, with the
repositories Tessera writes for library models (vLLM, TensorRT-LLM) and the memory fit per tier."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import BinaryIO

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from marketplace import enqueue, fit
from marketplace.hardware import model_repo, triton
from marketplace.models import LibraryModel, LoraAdapter, ModelDeployment, ModelRepository, Tier, UploadState
from tenants.errors import Conflict, Forbidden, ServiceError
from tenants.scoping import Principal

Source = ModelRepository.Source  # where a repository or an adapter came from (upload or the model store)

MIB = 1024 * 1024
log = logging.getLogger("tessera.models")


def upload_root() -> Path:
    return Path(settings.TESSERA_UPLOAD_ROOT)


def store_root() -> Path:
    return Path(settings.TESSERA_MODEL_STORE_ROOT)


def limits() -> model_repo.Limits:
    return model_repo.Limits(max_files=settings.TESSERA_REPO_MAX_FILES,
                             max_expanded_bytes=settings.TESSERA_REPO_MAX_EXPANDED_BYTES,
                             max_config_bytes=settings.TESSERA_REPO_MAX_CONFIG_BYTES,
                             max_seconds=settings.TESSERA_REPO_MAX_UNPACK_SECONDS)


def archive_path(obj: ModelRepository | LoraAdapter) -> Path:
    """Where the web request keeps an uploaded archive until the worker has unpacked it."""
    return upload_root() / f"{obj.path}.archive"


def node_roots() -> dict[str, str]:
    """The node folders a message may name, and what a tenant reads instead (``model_repo.scrub_paths``)."""
    return {str(upload_root()): "", str(store_root()): "model-store", str(settings.TESSERA_TRITON_REPO_ROOT): ""}


# --- uploads: the web request stores, a control worker unpacks and validates ------------------------
#
# upload_repository / import_from_store / upload_adapter / adapter_from_store run in the web request: they check
# what is cheap (role, name, archive size and kind, the member headers a zip's central directory or the first
# TESSERA_UPLOAD_PRESCAN_BYTES of a tar.gz show), store the archive under TESSERA_UPLOAD_ROOT and record the
# object "validating"; refusals there are ServiceErrors (400). After the commit, tessera.validate_repository /
# tessera.validate_adapter (control queue) run validate() below: unpack within the limits, check, then "ready" or
# "failed" with a reason a tenant may read.

KINDS: dict[str, type[ModelRepository] | type[LoraAdapter]] = {"repository": ModelRepository, "adapter": LoraAdapter}
TASKS = {"repository": enqueue.VALIDATE_REPOSITORY, "adapter": enqueue.VALIDATE_ADAPTER}


def _may_add(principal: Principal, tenant, name: str, model: type[ModelRepository] | type[LoraAdapter],
             what: str) -> None:
    if not principal.can("deploy", tenant.pk):
        raise Forbidden(f"Your role or API-key scopes do not allow adding {what}.")
    if not triton.MODEL_NAME_RE.match(name or ""):
        raise ServiceError("1 to 64 characters from a-z A-Z 0-9 _ -", field="name")
    if model.objects.filter(tenant=tenant, name=name).exclude(state=UploadState.FAILED).exists():
        raise ServiceError(f"{'an adapter' if model is LoraAdapter else 'a repository'} named {name} exists; "
                           "choose another name", field="name")


def _receive(upload, dest: Path) -> tuple[int, str]:
    """Copy an uploaded archive (a temporary file: marketplace.uploads.CappedUploadHandler) into ``dest``, chunk by
    chunk, within TESSERA_UPLOAD_MAX_BYTES: (its size, SHA-256)."""
    limit = settings.TESSERA_UPLOAD_MAX_BYTES
    size = getattr(upload, "size", 0) or 0
    if size > limit:
        raise ServiceError(f"the archive is {size:,} bytes; the limit is {limit:,}", field="archive")
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest, written = hashlib.sha256(), 0
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        for chunk in upload.chunks():
            written += len(chunk)
            if written > limit:
                raise ServiceError(f"the archive is over the limit of {limit:,} bytes", field="archive")
            digest.update(chunk)
            out.write(chunk)
    return written, digest.hexdigest()


def _prescan(source: Path, *, filename: str, field: str) -> None:
    """The member checks the archive's headers allow, bounded (model_repo.prescan): a refusal is a 400 now."""
    try:
        model_repo.prescan(source, limits(), filename=filename, budget_bytes=settings.TESSERA_UPLOAD_PRESCAN_BYTES)
    except model_repo.RepoError as exc:
        raise ServiceError(str(exc), field=field) from None


def _record(kind: str, tenant, name: str, fields: dict, *, archive: Path | None = None):
    """The object, "validating", replacing a failed one of the same name; its validation is queued on the
    control queue when the transaction commits. On any failure the stored archive goes too."""
    model = KINDS[kind]
    try:
        with transaction.atomic():
            for old in model.objects.select_for_update().filter(tenant=tenant, name=name, state=UploadState.FAILED):
                _remove_files(old)
                old.delete()
            obj = model.objects.create(tenant=tenant, name=name, state=UploadState.VALIDATING, **fields)
            transaction.on_commit(functools.partial(enqueue.send, TASKS[kind], [obj.pk], "control"))
    except IntegrityError:  # a concurrent upload of the same name won
        if archive is not None:
            archive.unlink(missing_ok=True)
        raise ServiceError(f"{'an adapter' if kind == 'adapter' else 'a repository'} named {name} exists; choose "
                           "another name", field="name") from None
    except BaseException:
        if archive is not None:
            archive.unlink(missing_ok=True)
        raise
    return obj


def _stored_upload(upload, rel: str) -> tuple[Path, int, str, str]:
    """The uploaded archive stored as ``<rel>.archive`` and pre-scanned: (its path, size, SHA-256, file name)."""
    filename = (getattr(upload, "name", "") or "")[:255]
    archive = upload_root() / f"{rel}.archive"
    try:
        size, sha = _receive(upload, archive)
        _prescan(archive, filename=filename, field="archive")
    except BaseException:
        archive.unlink(missing_ok=True)
        raise
    return archive, size, sha, filename


def _new_rel(tenant, prefix: str = "") -> str:
    return f"{tenant.slug}/{prefix}{uuid.uuid4().hex}"


def upload_repository(principal: Principal, tenant, name: str, upload) -> ModelRepository:
    """A Triton repository archive (tar.gz or zip) uploaded by a tenant: stored, pre-scanned and recorded
    "validating" (a refusal is a 400 naming the file and stores nothing); a control worker unpacks it."""
    _may_add(principal, tenant, name, ModelRepository, "model repositories")
    rel = _new_rel(tenant)
    archive, size, sha, filename = _stored_upload(upload, rel)
    return _record("repository", tenant, name, {
        "source": Source.UPLOAD, "filename": filename, "archive_bytes": size, "archive_sha256": sha, "path": rel,
        "created_by": principal.user}, archive=archive)


def _store_object(store_path: str) -> Path:
    """A path inside TESSERA_MODEL_STORE_ROOT (no '..', no absolute path, no symlink out of it)."""
    root = store_root().resolve()
    raw = (store_path or "").strip()
    if not raw or raw.startswith("/") or ".." in raw.split("/") or "\\" in raw or "\x00" in raw:
        raise ServiceError("a path relative to the model store, without '..'", field="store_path")
    path = root / raw
    if path.is_symlink() or not path.resolve().is_relative_to(root) or not path.exists():
        raise ServiceError(f"{model_repo.shown(raw)}: no such object in the model store", field="store_path")
    return path


def _store_key(store_path: str) -> str:
    raw = (store_path or "").strip()
    if (not raw or raw.startswith("/") or ".." in raw.split("/") or "\\" in raw or "\x00" in raw
            or "://" in raw or len(raw) > 500):
        raise ServiceError("an object key relative to the model store, without '..' (not a URL)", field="store_path")
    return raw


def _s3_client():
    import boto3

    return boto3.client("s3", endpoint_url=settings.TESSERA_MODEL_STORE_S3_ENDPOINT or None,
                        region_name=settings.TESSERA_MODEL_STORE_S3_REGION,
                        aws_access_key_id=settings.TESSERA_MODEL_STORE_S3_ACCESS_KEY_ID or None,
                        aws_secret_access_key=settings.TESSERA_MODEL_STORE_S3_SECRET_ACCESS_KEY or None)


def _s3_head(store_path: str) -> int:
    """The archive object's size, from a HEAD request (the web request fetches nothing): it must exist under the
    operator's prefix (the tenant names a key, so Tessera fetches nothing else) and be within
    TESSERA_UPLOAD_MAX_BYTES."""
    from botocore.exceptions import BotoCoreError, ClientError

    key = settings.TESSERA_MODEL_STORE_S3_PREFIX + _store_key(store_path)
    try:
        head = _s3_client().head_object(Bucket=settings.TESSERA_MODEL_STORE_S3_BUCKET, Key=key)
    except (ClientError, BotoCoreError):
        raise ServiceError(f"{store_path.strip()}: no such object in the model store", field="store_path") from None
    size = int(head.get("ContentLength", 0))
    if size > settings.TESSERA_UPLOAD_MAX_BYTES:
        raise ServiceError(f"the archive is {size:,} bytes; the limit is {settings.TESSERA_UPLOAD_MAX_BYTES:,}",
                           field="store_path")
    return size


def _s3_download(store_path: str) -> tuple[BinaryIO, int, str]:
    """The archive object, downloaded (worker side) to a temporary file within TESSERA_UPLOAD_MAX_BYTES, as
    (file, size, SHA-256)."""
    from botocore.exceptions import BotoCoreError, ClientError

    key = settings.TESSERA_MODEL_STORE_S3_PREFIX + _store_key(store_path)
    limit = settings.TESSERA_UPLOAD_MAX_BYTES
    try:
        obj = _s3_client().get_object(Bucket=settings.TESSERA_MODEL_STORE_S3_BUCKET, Key=key)
    except (ClientError, BotoCoreError):
        raise model_repo.RepoError(f"{store_path.strip()}: no such object in the model store") from None
    fh = tempfile.TemporaryFile()
    digest, size = hashlib.sha256(), 0
    for chunk in obj["Body"].iter_chunks(1024 * 1024):
        size += len(chunk)
        if size > limit:  # a server that lied about the length
            fh.close()
            raise model_repo.RepoError(f"the archive is over the limit of {limit:,} bytes")
        digest.update(chunk)
        fh.write(chunk)
    fh.seek(0)
    return fh, size, digest.hexdigest()


def import_from_store(principal: Principal, tenant, name: str, store_path: str) -> ModelRepository:
    """An object of the MSP's model store: a repository folder or an archive under TESSERA_MODEL_STORE_ROOT, or,
    with TESSERA_MODEL_STORE_S3_BUCKET set, an archive object under the S3 store's prefix. Checked for existence
    and size here (an archive file of the local store is pre-scanned like an upload); a control worker fetches,
    unpacks and validates it like an upload."""
    raw = (store_path or "").strip()
    if settings.TESSERA_MODEL_STORE_S3_BUCKET:
        _may_add(principal, tenant, name, ModelRepository, "model repositories")  # before any request
        size = _s3_head(store_path)
        return _record("repository", tenant, name, {
            "source": Source.STORE, "store_path": raw, "filename": raw.rsplit("/", 1)[-1][:255],
            "archive_bytes": size, "path": _new_rel(tenant), "created_by": principal.user})
    _may_add(principal, tenant, name, ModelRepository, "model repositories")
    path = _store_object(store_path)
    if path.is_file():
        _prescan(path, filename=path.name, field="store_path")
    return _record("repository", tenant, name, {
        "source": Source.STORE, "store_path": raw, "filename": path.name[:255],
        "archive_bytes": path.stat().st_size if path.is_file() else 0, "path": _new_rel(tenant),
        "created_by": principal.user})


def _check_base(base: LibraryModel) -> None:
    if base.backend != "vllm":
        raise ServiceError(f"LoRA adapters are served by vLLM; {base.name} runs on {base.backend}", field="base")


def upload_adapter(principal: Principal, tenant, name: str, base: LibraryModel, upload) -> LoraAdapter:
    """A LoRA adapter archive (PEFT's adapter_config.json + adapter_model.safetensors): stored, pre-scanned and
    recorded "validating" like a repository (paths, links, devices, file count, expanded size)."""
    _may_add(principal, tenant, name, LoraAdapter, "LoRA adapters")
    _check_base(base)
    rel = _new_rel(tenant, "lora-")
    archive, _size, sha, filename = _stored_upload(upload, rel)
    return _record("adapter", tenant, name, {
        "base": base, "source": Source.UPLOAD, "filename": filename, "archive_sha256": sha, "path": rel,
        "created_by": principal.user}, archive=archive)


def adapter_from_store(principal: Principal, tenant, name: str, base: LibraryModel, store_path: str) -> LoraAdapter:
    _may_add(principal, tenant, name, LoraAdapter, "LoRA adapters")
    _check_base(base)
    path = _store_object(store_path)
    if path.is_file():
        _prescan(path, filename=path.name, field="store_path")
    return _record("adapter", tenant, name, {
        "base": base, "source": Source.STORE, "store_path": (store_path or "").strip(), "filename": path.name[:255],
        "path": _new_rel(tenant, "lora-"), "created_by": principal.user})


# --- the control worker's side ---------------------------------------------------------------------

INTERNAL_FAILURE = ("it could not be stored on the server (an internal error, not a problem of the archive); "
                    "upload it again, or ask your provider if it happens again")


class _Source:
    """What a validation unpacks: the stored upload, a model-store folder or archive, or an S3 object."""

    def __init__(self, obj: ModelRepository | LoraAdapter) -> None:
        self.obj = obj
        self.fh: BinaryIO | None = None

    def __enter__(self) -> tuple[BinaryIO | Path, str]:
        obj = self.obj
        if obj.source == Source.UPLOAD:
            archive = archive_path(obj)
            if not archive.is_file():
                raise model_repo.RepoError("the uploaded archive is no longer on the server; upload it again")
            return archive, obj.filename
        if settings.TESSERA_MODEL_STORE_S3_BUCKET and isinstance(obj, ModelRepository):
            fh, _size, sha = _s3_download(obj.store_path)
            self.fh = fh
            if not obj.archive_sha256:
                ModelRepository.objects.filter(pk=obj.pk).update(archive_sha256=sha)
            return fh, obj.filename
        try:
            return _store_object(obj.store_path), obj.filename
        except ServiceError as exc:
            raise model_repo.RepoError(exc.message) from None

    def __exit__(self, *exc) -> None:
        if self.fh is not None:
            self.fh.close()


def _finish(kind: str, pk: int, **fields) -> bool:
    """Record the outcome unless the object was deleted (or finished) meanwhile."""
    fields.setdefault("validated_at", timezone.now())
    return KINDS[kind].objects.filter(pk=pk, state=UploadState.VALIDATING).update(**fields) == 1


def fail_validation(kind: str, pk: int, reason: str) -> None:
    """Mark a validation failed with ``reason`` (a refusal's words: the node's own folders made relative, should
    one ever appear), its files removed."""
    obj = KINDS[kind].objects.filter(pk=pk).first()
    if obj is None:
        return
    shutil.rmtree(upload_root() / obj.path, ignore_errors=True)
    archive_path(obj).unlink(missing_ok=True)
    _finish(kind, pk, state=UploadState.FAILED,
            failure_reason=model_repo.scrub_paths(reason, node_roots(), any_path=False)[:2000])


def validate(kind: str, pk: int, *, final_attempt: bool = True) -> str:
    """The control worker's part (tessera.validate_repository / tessera.validate_adapter): unpack the stored
    archive (or the model-store object) within the limits, validate it, then "ready" with what it holds, or
    "failed" with a reason that names files inside the archive only. Idempotent: a repeated or late run does
    nothing; the leftovers of a run that died are removed first. A failure of the server itself (disk, NFS)
    raises ``model_repo.StorageError`` to be retried, and fails the object on the final attempt."""
    model = KINDS[kind]
    obj = model.objects.filter(pk=pk).first()
    if obj is None:
        return "gone"
    if obj.state != UploadState.VALIDATING:
        return f"nothing to do ({obj.state})"
    dest = upload_root() / obj.path
    shutil.rmtree(dest, ignore_errors=True)  # a run that died between its rename and its update
    for leftover in dest.parent.glob(f".{dest.name}.staging-*"):  # a run that died while unpacking
        shutil.rmtree(leftover, ignore_errors=True)
    check: model_repo.Validate[object] = model_repo.validate_adapter if kind == "adapter" else model_repo.validate_tree
    try:
        with _Source(obj) as (source, filename):
            result = model_repo.import_repository(source, dest, limits(), filename=filename, validate=check)
    except model_repo.RepoError as exc:
        fail_validation(kind, pk, str(exc))
        log.info("upload refused", extra={"kind": kind, "id": pk, "tenant": obj.tenant_id})
        return "failed"
    except (model_repo.StorageError, OSError) as exc:
        log.warning("upload could not be stored", extra={"kind": kind, "id": pk, "err": str(exc)})
        if not final_attempt:
            raise model_repo.StorageError(str(exc)) from None
        fail_validation(kind, pk, INTERNAL_FAILURE)
        return "failed"
    fields: dict[str, object]
    if isinstance(result, model_repo.Adapter):
        fields = {"rank": result.rank, "target_modules": result.target_modules, "size_bytes": result.size_bytes,
                  "file_count": result.file_count}
    elif isinstance(result, model_repo.Repo):
        fields = {"manifest": result.as_json(), "size_bytes": result.size_bytes, "file_count": result.file_count}
    else:  # never: validate_tree and validate_adapter return these
        raise TypeError(type(result))
    if not _finish(kind, pk, state=UploadState.READY, failure_reason="", **fields):
        shutil.rmtree(dest, ignore_errors=True)  # deleted (or failed by a time limit) meanwhile
        return "gone"
    archive_path(obj).unlink(missing_ok=True)
    return "ready"


def _remove_files(obj: ModelRepository | LoraAdapter) -> None:
    shutil.rmtree(upload_root() / obj.path, ignore_errors=True)
    archive_path(obj).unlink(missing_ok=True)


def require_ready(obj: ModelRepository | LoraAdapter, field: str) -> None:
    """Deploying (or sizing) a repository or adapter needs it validated: a clear 409 while it is not."""
    what = "adapter" if isinstance(obj, LoraAdapter) else "repository"
    if obj.state == UploadState.VALIDATING:
        raise Conflict(f"{what} {obj.name} is still being validated; deploy it when it is ready", field=field)
    if obj.state == UploadState.FAILED:
        raise Conflict(f"{what} {obj.name} failed validation ({obj.failure_reason}); upload it again", field=field)


def delete_adapter(principal: Principal, adapter: LoraAdapter) -> None:
    if not principal.can("deploy", adapter.tenant_id):
        raise Forbidden("Your role or API-key scopes do not allow removing LoRA adapters.")
    if adapter.deployments.exclude(state=ModelDeployment.State.REMOVED).exists():
        raise ServiceError("this adapter is deployed; remove its deployment first", field="adapter")
    adapter.delete()
    _remove_files(adapter)


def delete_repository(principal: Principal, repo: ModelRepository) -> None:
    if not principal.can("deploy", repo.tenant_id):
        raise Forbidden("Your role or API-key scopes do not allow removing model repositories.")
    if repo.deployments.exclude(state=ModelDeployment.State.REMOVED).exists():
        raise ServiceError("models of this repository are deployed; remove them first", field="repository")
    repo.delete()
    _remove_files(repo)


def pick_model(repo: ModelRepository, model: str | None) -> tuple[dict, list[str]]:
    """The model a deployment serves (an ensemble brings its steps): (its manifest entry, folders to copy)."""
    by_name = {m["name"]: m for m in repo.manifest}
    if model:
        if model not in by_name:
            raise ServiceError(f"no model {model!r} in repository {repo.name} (it has {', '.join(by_name)})",
                               field="model")
        top = by_name[model]
    else:
        ensembles = [m for m in repo.manifest if m["backend"] == "ensemble"]
        if len(repo.manifest) == 1:
            top = repo.manifest[0]
        elif len(ensembles) == 1:
            top = ensembles[0]
        else:
            raise ServiceError(f"repository {repo.name} has several models; name one ({', '.join(by_name)})",
                               field="model")
    names, todo = [], [top["name"]]
    while todo:
        n = todo.pop()
        if n not in names:
            names.append(n)
            todo.extend(by_name[n].get("steps", []))
    return top, names


def repository_shape(repo: ModelRepository, names: list[str], memory_mb: int = 0) -> fit.ModelShape:
    """The fit of an uploaded repository: the declared memory (the deploy's memory_mb, else the configs'
    tessera_memory_mb), else its files' size, plus the runtime overhead of its backend."""
    entries = [m for m in repo.manifest if m["name"] in names]
    declared = memory_mb or sum(m.get("memory_mb") or 0 for m in entries)
    backend = next((m["backend"] for m in entries if m["backend"] != "ensemble"), "python")
    size = math.ceil(sum(m["size_bytes"] for m in entries) / MIB)
    return fit.ModelShape(name=repo.name, backend=backend, fixed_mib=declared or max(size, 1))


# --- the MSP's library -----------------------------------------------------------------------------

LIBRARY_SEED = Path(__file__).resolve().parents[1] / "data" / "model_library.json"


def sync_library() -> int:
    """Create or update the seeded library models (marketplace/data/model_library.json; migration 0010 does the
    same with the historical model). Returns how many entries the seed has."""
    data = json.loads(LIBRARY_SEED.read_text())
    for m in data["models"]:
        fields = {k: m[k] for k in ("name", "family", "params", "layers", "hidden_size", "attention_heads",
                                    "kv_heads", "head_dim", "weight_dtype", "kv_dtype", "max_context", "backend",
                                    "store_path")}
        LibraryModel.objects.update_or_create(key=m["key"], defaults={**fields, "source_url": m["source"]})
    return len(data["models"])

def library_shape(m: LibraryModel, adapters_mib: tuple[int, ...] = ()) -> fit.ModelShape:
    return fit.ModelShape(name=m.name, backend=m.backend, params=m.params, layers=m.layers, kv_heads=m.kv_heads,
                          head_dim=m.head_dim, weight_dtype=m.weight_dtype, kv_dtype=m.kv_dtype,
                          max_context=m.max_context, adapters_mib=adapters_mib)


VLLM_DTYPE = {"BF16": "bfloat16", "FP16": "float16"}
VLLM_KV_DTYPE = {"FP8": "fp8"}


VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted max_lora_rank values


def adapter_mib(adapter: LoraAdapter) -> int:
    return max(1, math.ceil(adapter.size_bytes / MIB))


def vllm_model_json(m: LibraryModel, result: fit.Fit, *, concurrency: int, adapters=()) -> dict:
    """The vLLM backend's ``model.json`` (engine arguments): the weights from the model store,
    ``gpu_memory_utilization`` and ``max_model_len`` from the fit on this slice; ``tensor_parallel_size`` the
    fit's (a multi-GPU tier's GPU count: the server sees exactly those GPUs, and the fit is per GPU)."""
    args = {
        "model": str(store_root() / m.store_path),
        "disable_log_requests": True,
        "tensor_parallel_size": result.tensor_parallel,
        "gpu_memory_utilization": fit.vllm_memory_utilization(result.needed_mib, result.slice_mib,
                                                              result.slice_mib - result.other_mib),
        "max_model_len": result.context,
        "max_num_seqs": concurrency,
    }
    if m.weight_dtype in VLLM_DTYPE:
        args["dtype"] = VLLM_DTYPE[m.weight_dtype]
    if m.kv_dtype in VLLM_KV_DTYPE:
        args["kv_cache_dtype"] = VLLM_KV_DTYPE[m.kv_dtype]
    if adapters:
        top = max(a.rank for a in adapters)
        args.update(enable_lora="true", max_loras=len(adapters),
                    max_lora_rank=next((r for r in VLLM_LORA_RANKS if r >= top), VLLM_LORA_RANKS[-1]))
    return args


def vllm_files(name: str, m: LibraryModel, result: fit.Fit, *, concurrency: int, adapters=()) -> dict[str, str]:
    """The Triton repository of a vLLM library model: ``<name>/config.pbtxt`` (backend vllm, KIND_MODEL: vLLM
    places itself on the slice's one device), ``<name>/1/model.json`` and, with LoRA adapters,
    ``<name>/1/multi_lora.json`` (adapter name -> its folder; a request picks one with the ``lora_name``
    parameter)."""
    config = "\n".join([
        f'name: "{name}"', 'backend: "vllm"',
        "instance_group [ { count: 1 kind: KIND_MODEL } ]",
        'model_transaction_policy { decoupled: true }',
        f'parameters {{ key: "{triton.MEMORY_PARAMETER}" value: {{ string_value: "{result.needed_mib}" }} }}',
    ]) + "\n"
    files = {f"{name}/config.pbtxt": config,
             f"{name}/1/model.json": json.dumps(vllm_model_json(m, result, concurrency=concurrency,
                                                                adapters=adapters), indent=2) + "\n"}
    if adapters:  # copied into the model folder at deploy (adapter_dirs): the server reads nothing outside it
        files[f"{name}/1/multi_lora.json"] = json.dumps(
            {a.name: f"{model_repo.MODEL_DIR_PLACEHOLDER}/1/loras/{a.name}" for a in adapters}, indent=2,
            sort_keys=True) + "\n"
    return files


def adapter_dirs(name: str, adapters) -> dict[str, str]:
    """Where each adapter goes in the model folder -> its folder, relative to TESSERA_UPLOAD_ROOT."""
    return {f"{name}/1/loras/{a.name}": a.path for a in adapters}


# The sampling inputs of Tessera's TensorRT-LLM ensemble, all optional: (the ensemble's input, the tensorrt_llm
# model's input it feeds, data type), named as in NVIDIA's inflight_batcher_llm ensemble and tensorrt_llm configs
# (https://github.com/triton-inference-server/tensorrtllm_backend, docs/model_config.md). The gateway passes the
# OpenAI fields of the same names to them (temperature, top_p, top_k, seed -> random_seed, the penalties).
TENSORRTLLM_SAMPLING = (
    ("temperature", "temperature", "TYPE_FP32"),
    ("top_p", "runtime_top_p", "TYPE_FP32"),
    ("top_k", "runtime_top_k", "TYPE_INT32"),
    ("random_seed", "random_seed", "TYPE_UINT64"),
    ("presence_penalty", "presence_penalty", "TYPE_FP32"),
    ("frequency_penalty", "frequency_penalty", "TYPE_FP32"),
    ("repetition_penalty", "repetition_penalty", "TYPE_FP32"),
)


def tensorrtllm_files(name: str, m: LibraryModel, result: fit.Fit, *, concurrency: int) -> dict[str, str]:
    """The TensorRT-LLM ensemble layout (NVIDIA's tensorrtllm_backend ``inflight_batcher_llm``): ``<name>``
    (ensemble: preprocessing -> tensorrt_llm -> postprocessing) and the three steps. The engine and tokenizer
    are in the model store at ``<store_path>/engine`` and ``<store_path>/tokenizer``; the pre/postprocessing
    ``model.py`` files are NVIDIA's (copied from ``<store_path>/preprocessing|postprocessing/1/`` at deploy)."""
    base = store_root() / m.store_path
    pre, llm, post = f"{name}-pre", f"{name}-llm", f"{name}-post"
    kv_fraction = max(0.05, min(0.95, math.floor(
        result.kv_mib / max(1.0, result.slice_mib - result.weights_mib - result.overhead_mib) * 100) / 100))
    tensor = 'input [ {{ name: "{0}" data_type: {1} dims: [ {2} ] }} ]'

    def param(key, value):
        return f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}'

    files = {
        f"{pre}/config.pbtxt": "\n".join([
            f'name: "{pre}"', 'backend: "python"', f"max_batch_size: {concurrency}",
            tensor.format("QUERY", "TYPE_STRING", "1"), tensor.format("REQUEST_OUTPUT_LEN", "TYPE_INT32", "1"),
            'output [ { name: "INPUT_ID" data_type: TYPE_INT32 dims: [ -1 ] }, '
            '{ name: "REQUEST_INPUT_LEN" data_type: TYPE_INT32 dims: [ 1 ] }, '
            '{ name: "REQUEST_OUTPUT_LEN" data_type: TYPE_INT32 dims: [ 1 ] } ]',
            "instance_group [ { count: 1 kind: KIND_CPU } ]", param("tokenizer_dir", base / "tokenizer")]) + "\n",
        f"{llm}/config.pbtxt": "\n".join([
            f'name: "{llm}"', 'backend: "tensorrtllm"', f"max_batch_size: {concurrency}",
            "model_transaction_policy { decoupled: false }",
            'input [ { name: "input_ids" data_type: TYPE_INT32 dims: [ -1 ] }, '
            '{ name: "input_lengths" data_type: TYPE_INT32 dims: [ 1 ] reshape: { shape: [ ] } }, '
            '{ name: "request_output_len" data_type: TYPE_INT32 dims: [ 1 ] reshape: { shape: [ ] } }'
            + "".join(f', {{ name: "{llm_in}" data_type: {dtype} dims: [ 1 ] reshape: {{ shape: [ ] }} '
                      f'optional: true }}' for _, llm_in, dtype in TENSORRTLLM_SAMPLING) + ' ]',
            'output [ { name: "output_ids" data_type: TYPE_INT32 dims: [ -1, -1 ] } ]',
            "instance_group [ { count: 1 kind: KIND_CPU } ]",  # TensorRT-LLM picks the device itself
            param("gpt_model_type", "inflight_fused_batching"), param("gpt_model_path", base / "engine"),
            param("max_tokens_in_paged_kv_cache", result.context * concurrency),
            param("kv_cache_free_gpu_mem_fraction", kv_fraction),
            param(triton.MEMORY_PARAMETER, result.needed_mib)]) + "\n",
        f"{post}/config.pbtxt": "\n".join([
            f'name: "{post}"', 'backend: "python"', f"max_batch_size: {concurrency}",
            tensor.format("TOKENS_BATCH", "TYPE_INT32", "-1, -1"),
            'output [ { name: "OUTPUT" data_type: TYPE_STRING dims: [ -1 ] } ]',
            "instance_group [ { count: 1 kind: KIND_CPU } ]", param("tokenizer_dir", base / "tokenizer")]) + "\n",
        f"{name}/config.pbtxt": "\n".join([
            f'name: "{name}"', 'platform: "ensemble"', f"max_batch_size: {concurrency}",
            'input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }, '
            '{ name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] }'
            + "".join(f', {{ name: "{ens_in}" data_type: {dtype} dims: [ 1 ] optional: true }}'
                      for ens_in, _, dtype in TENSORRTLLM_SAMPLING) + ' ]',
            'output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]',
            "ensemble_scheduling { step [",
            f'  {{ model_name: "{pre}" model_version: -1 input_map {{ key: "QUERY" value: "text_input" }} '
            'input_map { key: "REQUEST_OUTPUT_LEN" value: "max_tokens" } '
            'output_map { key: "INPUT_ID" value: "_ids" } output_map { key: "REQUEST_INPUT_LEN" value: "_len" } '
            'output_map { key: "REQUEST_OUTPUT_LEN" value: "_out_len" } },',
            f'  {{ model_name: "{llm}" model_version: -1 input_map {{ key: "input_ids" value: "_ids" }} '
            'input_map { key: "input_lengths" value: "_len" } '
            'input_map { key: "request_output_len" value: "_out_len" } '
            + "".join(f'input_map {{ key: "{llm_in}" value: "{ens_in}" }} '
                      for ens_in, llm_in, _ in TENSORRTLLM_SAMPLING)
            + 'output_map { key: "output_ids" value: "_tokens" } },',
            f'  {{ model_name: "{post}" model_version: -1 input_map {{ key: "TOKENS_BATCH" value: "_tokens" }} '
            'output_map { key: "OUTPUT" value: "text_output" } }',
            "] }"]) + "\n",
        f"{name}/1/.keep": "",
        f"{llm}/1/.keep": "",
    }
    return files


def tensorrtllm_copies(name: str, m: LibraryModel) -> dict[str, str]:
    """NVIDIA's pre/postprocessing model.py files, copied from the model store onto the slice at deploy."""
    base = store_root() / m.store_path
    return {f"{name}-pre/1/model.py": str(base / "preprocessing/1/model.py"),
            f"{name}-post/1/model.py": str(base / "postprocessing/1/model.py")}


def library_files(name: str, m: LibraryModel, result: fit.Fit, *, concurrency: int, adapters=()) -> dict[str, str]:
    if m.backend == "vllm":
        files = vllm_files(name, m, result, concurrency=concurrency, adapters=adapters)
    else:
        if adapters:
            raise ServiceError("LoRA adapters are served with vLLM library models", field="adapters")
        files = tensorrtllm_files(name, m, result, concurrency=concurrency)
    for path, text in files.items():  # every generated config is checked against Triton's own schema
        if path.endswith("/config.pbtxt"):
            triton.parse_model_config(text)
    return files


def model_names(files: dict[str, str]) -> list[str]:
    return sorted({p.split("/", 1)[0] for p in files})


# --- fit per tier ---------------------------------------------------------------------------------

def fit_tiers(shape: fit.ModelShape, *, context: int = 0, concurrency: int = 1,
              tiers=None) -> list[tuple[Tier, fit.Fit]]:
    """The fit on every active tier (catalog memory of its slice; a multi-GPU tier: per GPU, tensor parallel over
    its GPUs), largest headroom last."""
    qs = tiers if tiers is not None else Tier.objects.filter(active=True).select_related("gpu_model", "profile")
    out = []
    for t in qs:
        if shape.backend not in t.backends and shape.backend != "ensemble":
            continue
        out.append((t, fit.fit(shape, t.gpu_memory_mib, context=context, concurrency=concurrency,
                               tensor_parallel=t.gpu_count)))
    return out


def check_tier_fits(tier: Tier, library_model: LibraryModel, *, context: int = 0, concurrency: int = 1) -> fit.Fit:
    """An order made for a model: refused (400, with the numbers) when the model cannot run on the tier."""
    if library_model.backend not in tier.backends:
        raise ServiceError(f"{tier.name} does not offer the {library_model.backend} backend", field="library_model")
    if context > library_model.max_context:
        raise ServiceError(f"context {context:,} exceeds {library_model.name}'s max context of "
                           f"{library_model.max_context:,} tokens", field="context")
    result = fit.fit(library_shape(library_model), tier.gpu_memory_mib, context=context or 1, concurrency=concurrency,
                     tensor_parallel=tier.gpu_count)
    if not result.fits:
        raise ServiceError(f"{result.reason} on {tier.name}; find a tier that fits at /portal/find-tier/ or "
                           "POST /api/v1/find-tier/", field="tier", code="does_not_fit")
    return result
