"""Models tenants run: their own Triton repositories (upload or model store) and the MSP's library, with the
repositories Tessera writes for library models (vLLM, TensorRT-LLM) and the memory fit per tier."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import uuid
from pathlib import Path
from typing import BinaryIO

from django.conf import settings
from django.db import transaction

from marketplace import fit
from marketplace.hardware import model_repo, triton
from marketplace.models import LibraryModel, LoraAdapter, ModelDeployment, ModelRepository, Tier
from tenants.errors import Forbidden, ServiceError
from tenants.scoping import Principal

Source = ModelRepository.Source  # where a repository or an adapter came from (upload or the model store)

MIB = 1024 * 1024


def upload_root() -> Path:
    return Path(settings.TESSERA_UPLOAD_ROOT)


def store_root() -> Path:
    return Path(settings.TESSERA_MODEL_STORE_ROOT)


def limits() -> model_repo.Limits:
    return model_repo.Limits(max_files=settings.TESSERA_REPO_MAX_FILES,
                             max_expanded_bytes=settings.TESSERA_REPO_MAX_EXPANDED_BYTES)


def repository_path(repo: ModelRepository) -> Path:
    return upload_root() / repo.path


# --- a tenant's own repository ------------------------------------------------------------------

def _store(principal: Principal, tenant, name: str, source: BinaryIO | Path, *, kind: str, filename: str = "",
           store_path: str = "", size: int = 0, sha: str = "") -> ModelRepository:
    if not principal.can("deploy", tenant.pk):
        raise Forbidden("Your role or API-key scopes do not allow adding model repositories.")
    if not triton.MODEL_NAME_RE.match(name or ""):
        raise ServiceError("1 to 64 characters from a-z A-Z 0-9 _ -", field="name")
    if ModelRepository.objects.filter(tenant=tenant, name=name).exists():
        raise ServiceError(f"a repository named {name} exists; choose another name", field="name")
    rel = f"{tenant.slug}/{uuid.uuid4().hex}"
    dest = upload_root() / rel
    try:
        repo = model_repo.import_repository(source, dest, limits(), filename=filename)
    except model_repo.RepoError as exc:
        raise ServiceError(str(exc), field="archive" if kind == Source.UPLOAD else "store_path") from None
    try:
        with transaction.atomic():
            return ModelRepository.objects.create(
                tenant=tenant, name=name, source=kind, store_path=store_path, filename=filename[:255],
                archive_bytes=size, archive_sha256=sha, size_bytes=repo.size_bytes, file_count=repo.file_count,
                manifest=repo.as_json(), path=rel, created_by=principal.user)
    except BaseException:  # the row was not stored (a name race): the files go too
        shutil.rmtree(dest, ignore_errors=True)
        raise


def _checked_upload(upload) -> tuple:
    """An uploaded archive within TESSERA_UPLOAD_MAX_BYTES: (its file, size, SHA-256), rewound for unpacking."""
    size = getattr(upload, "size", 0) or 0
    if size > settings.TESSERA_UPLOAD_MAX_BYTES:
        raise ServiceError(f"the archive is {size:,} bytes; the limit is {settings.TESSERA_UPLOAD_MAX_BYTES:,}",
                           field="archive")
    digest = hashlib.sha256()
    for chunk in upload.chunks():
        digest.update(chunk)
    upload.seek(0)
    return (upload.file if hasattr(upload, "file") else upload), size, digest.hexdigest()


def upload_repository(principal: Principal, tenant, name: str, upload) -> ModelRepository:
    """A Triton repository archive (tar.gz or zip) uploaded by a tenant: validated, unpacked under
    TESSERA_UPLOAD_ROOT; a refusal is a 400 naming the file and stores nothing."""
    fh, size, sha = _checked_upload(upload)
    return _store(principal, tenant, name, fh, kind=Source.UPLOAD, filename=getattr(upload, "name", "") or "",
                  size=size, sha=sha)


def _store_object(store_path: str) -> Path:
    """A path inside TESSERA_MODEL_STORE_ROOT (no '..', no absolute path, no symlink out of it)."""
    root = store_root().resolve()
    raw = (store_path or "").strip()
    if not raw or raw.startswith("/") or ".." in raw.split("/") or "\\" in raw or "\x00" in raw:
        raise ServiceError("a path relative to the model store, without '..'", field="store_path")
    path = root / raw
    if path.is_symlink() or not path.resolve().is_relative_to(root) or not path.exists():
        raise ServiceError(f"{raw}: no such object in the model store", field="store_path")
    return path


def _store_key(store_path: str) -> str:
    raw = (store_path or "").strip()
    if (not raw or raw.startswith("/") or ".." in raw.split("/") or "\\" in raw or "\x00" in raw
            or "://" in raw or len(raw) > 500):
        raise ServiceError("an object key relative to the model store, without '..' (not a URL)", field="store_path")
    return raw


def _s3_object(store_path: str) -> tuple[BinaryIO, int, str]:
    """An archive object of the operator's S3-compatible store (endpoint, bucket and prefix are settings; the
    tenant names a key under the prefix only, so it cannot make Tessera fetch anything else): downloaded to a
    temporary file within TESSERA_UPLOAD_MAX_BYTES, as (file, size, SHA-256)."""
    import tempfile

    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    key = settings.TESSERA_MODEL_STORE_S3_PREFIX + _store_key(store_path)
    limit = settings.TESSERA_UPLOAD_MAX_BYTES
    client = boto3.client("s3", endpoint_url=settings.TESSERA_MODEL_STORE_S3_ENDPOINT or None,
                          region_name=settings.TESSERA_MODEL_STORE_S3_REGION,
                          aws_access_key_id=settings.TESSERA_MODEL_STORE_S3_ACCESS_KEY_ID or None,
                          aws_secret_access_key=settings.TESSERA_MODEL_STORE_S3_SECRET_ACCESS_KEY or None)
    try:
        obj = client.get_object(Bucket=settings.TESSERA_MODEL_STORE_S3_BUCKET, Key=key)
    except (ClientError, BotoCoreError):
        raise ServiceError(f"{store_path.strip()}: no such object in the model store", field="store_path") from None
    if obj.get("ContentLength", 0) > limit:
        obj["Body"].close()
        raise ServiceError(f"the archive is {obj['ContentLength']:,} bytes; the limit is {limit:,}", field="store_path")
    fh = tempfile.TemporaryFile()
    digest, size = hashlib.sha256(), 0
    for chunk in obj["Body"].iter_chunks(1024 * 1024):
        size += len(chunk)
        if size > limit:  # a server that lied about the length
            fh.close()
            raise ServiceError(f"the archive is over the limit of {limit:,} bytes", field="store_path")
        digest.update(chunk)
        fh.write(chunk)
    fh.seek(0)
    return fh, size, digest.hexdigest()


def import_from_store(principal: Principal, tenant, name: str, store_path: str) -> ModelRepository:
    """An object of the MSP's model store: a repository folder or an archive under TESSERA_MODEL_STORE_ROOT, or,
    with TESSERA_MODEL_STORE_S3_BUCKET set, an archive object under the S3 store's prefix (validated like an
    upload)."""
    if settings.TESSERA_MODEL_STORE_S3_BUCKET:
        if not principal.can("deploy", tenant.pk):  # before any fetch
            raise Forbidden("Your role or API-key scopes do not allow adding model repositories.")
        fh, size, sha = _s3_object(store_path)
        with fh:
            return _store(principal, tenant, name, fh, kind=Source.STORE,
                          filename=store_path.strip().rsplit("/", 1)[-1], store_path=store_path.strip(), size=size,
                          sha=sha)
    path = _store_object(store_path)
    raw = store_path.strip()
    return _store(principal, tenant, name, path, kind=Source.STORE, filename=path.name, store_path=raw,
                  size=path.stat().st_size if path.is_file() else 0)


def _store_adapter(principal: Principal, tenant, name: str, base: LibraryModel, source: BinaryIO | Path, *,
                   kind: str, filename: str = "", store_path: str = "", sha: str = "") -> LoraAdapter:
    if not principal.can("deploy", tenant.pk):
        raise Forbidden("Your role or API-key scopes do not allow adding LoRA adapters.")
    if not triton.MODEL_NAME_RE.match(name or ""):
        raise ServiceError("1 to 64 characters from a-z A-Z 0-9 _ -", field="name")
    if base.backend != "vllm":
        raise ServiceError(f"LoRA adapters are served by vLLM; {base.name} runs on {base.backend}", field="base")
    if LoraAdapter.objects.filter(tenant=tenant, name=name).exists():
        raise ServiceError(f"an adapter named {name} exists; choose another name", field="name")
    rel = f"{tenant.slug}/lora-{uuid.uuid4().hex}"
    dest = upload_root() / rel
    try:
        ad = model_repo.import_repository(source, dest, limits(), filename=filename,
                                          validate=model_repo.validate_adapter)
    except model_repo.RepoError as exc:
        raise ServiceError(str(exc), field="archive" if kind == Source.UPLOAD else "store_path") from None
    try:
        with transaction.atomic():
            return LoraAdapter.objects.create(
                tenant=tenant, name=name, base=base, source=kind, store_path=store_path, filename=filename[:255],
                archive_sha256=sha, rank=ad.rank, target_modules=ad.target_modules, size_bytes=ad.size_bytes,
                file_count=ad.file_count, path=rel, created_by=principal.user)
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise


def upload_adapter(principal: Principal, tenant, name: str, base: LibraryModel, upload) -> LoraAdapter:
    """A LoRA adapter archive (PEFT's adapter_config.json + adapter_model.safetensors), validated like a
    repository (paths, links, devices, file count, expanded size)."""
    fh, _size, sha = _checked_upload(upload)
    return _store_adapter(principal, tenant, name, base, fh, kind=Source.UPLOAD,
                          filename=getattr(upload, "name", "") or "", sha=sha)


def adapter_from_store(principal: Principal, tenant, name: str, base: LibraryModel, store_path: str) -> LoraAdapter:
    path = _store_object(store_path)
    return _store_adapter(principal, tenant, name, base, path, kind=Source.STORE, filename=path.name,
                          store_path=store_path)


def delete_adapter(principal: Principal, adapter: LoraAdapter) -> None:
    if not principal.can("deploy", adapter.tenant_id):
        raise Forbidden("Your role or API-key scopes do not allow removing LoRA adapters.")
    if adapter.deployments.exclude(state=ModelDeployment.State.REMOVED).exists():
        raise ServiceError("this adapter is deployed; remove its deployment first", field="adapter")
    path = upload_root() / adapter.path
    adapter.delete()
    shutil.rmtree(path, ignore_errors=True)


def delete_repository(principal: Principal, repo: ModelRepository) -> None:
    if not principal.can("deploy", repo.tenant_id):
        raise Forbidden("Your role or API-key scopes do not allow removing model repositories.")
    if repo.deployments.exclude(state=ModelDeployment.State.REMOVED).exists():
        raise ServiceError("models of this repository are deployed; remove them first", field="repository")
    path = repository_path(repo)
    repo.delete()
    shutil.rmtree(path, ignore_errors=True)


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
    ``gpu_memory_utilization`` and ``max_model_len`` from the fit on this slice."""
    args = {
        "model": str(store_root() / m.store_path),
        "disable_log_requests": True,
        "tensor_parallel_size": 1,
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
            '{ name: "request_output_len" data_type: TYPE_INT32 dims: [ 1 ] reshape: { shape: [ ] } } ]',
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
            '{ name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] } ]',
            'output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]',
            "ensemble_scheduling { step [",
            f'  {{ model_name: "{pre}" model_version: -1 input_map {{ key: "QUERY" value: "text_input" }} '
            'input_map { key: "REQUEST_OUTPUT_LEN" value: "max_tokens" } '
            'output_map { key: "INPUT_ID" value: "_ids" } output_map { key: "REQUEST_INPUT_LEN" value: "_len" } '
            'output_map { key: "REQUEST_OUTPUT_LEN" value: "_out_len" } },',
            f'  {{ model_name: "{llm}" model_version: -1 input_map {{ key: "input_ids" value: "_ids" }} '
            'input_map { key: "input_lengths" value: "_len" } '
            'input_map { key: "request_output_len" value: "_out_len" } '
            'output_map { key: "output_ids" value: "_tokens" } },',
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
    """The fit on every active tier (catalog memory of its slice), largest headroom last."""
    qs = tiers if tiers is not None else Tier.objects.filter(active=True).select_related("gpu_model", "profile")
    out = []
    for t in qs:
        if shape.backend not in t.backends and shape.backend != "ensemble":
            continue
        out.append((t, fit.fit(shape, t.memory_mib, context=context, concurrency=concurrency)))
    return out


def check_tier_fits(tier: Tier, library_model: LibraryModel, *, context: int = 0, concurrency: int = 1) -> fit.Fit:
    """An order made for a model: refused (400, with the numbers) when the model cannot run on the tier."""
    if library_model.backend not in tier.backends:
        raise ServiceError(f"{tier.name} does not offer the {library_model.backend} backend", field="library_model")
    if context > library_model.max_context:
        raise ServiceError(f"context {context:,} exceeds {library_model.name}'s max context of "
                           f"{library_model.max_context:,} tokens", field="context")
    result = fit.fit(library_shape(library_model), tier.memory_mib, context=context or 1, concurrency=concurrency)
    if not result.fits:
        raise ServiceError(f"{result.reason} on {tier.name}; find a tier that fits at /portal/find-tier/ or "
                           "POST /api/v1/find-tier/", field="tier", code="does_not_fit")
    return result
