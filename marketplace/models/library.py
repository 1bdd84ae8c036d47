"""Models tenants run on slices: the MSP's curated library (published architectures, weights in the MSP's model
store) and a tenant's own uploaded Triton model repositories."""

from __future__ import annotations

from django.conf import settings
from django.core.validators import RegexValidator
from django.db import models
from django.utils import timezone

from tenants.scoping import TenantScopedQuerySet

DTYPES = [(d, d) for d in ("FP16", "BF16", "FP8", "INT8", "INT4")]
KV_DTYPES = [(d, d) for d in ("FP16", "BF16", "FP8", "INT8")]
LIBRARY_BACKENDS = [("vllm", "vLLM"), ("tensorrtllm", "TensorRT-LLM")]


class LibraryModel(models.Model):
    """An operator-curated model: its architecture (what the memory fit needs) and where its weights are."""

    key = models.CharField(max_length=80, unique=True, validators=[RegexValidator(
        r"^[a-z0-9][a-z0-9._-]*$", "lower-case letters, digits, . _ -")], help_text='e.g. "qwen2.5-7b-instruct"')
    name = models.CharField(max_length=120)
    family = models.CharField(max_length=40, help_text="llama, mixtral, qwen2, ...")
    params = models.PositiveBigIntegerField(help_text="parameter count (model card)")
    layers = models.PositiveIntegerField(help_text="num_hidden_layers")
    hidden_size = models.PositiveIntegerField()
    attention_heads = models.PositiveIntegerField(help_text="num_attention_heads")
    kv_heads = models.PositiveIntegerField(help_text="num_key_value_heads")
    head_dim = models.PositiveIntegerField()
    weight_dtype = models.CharField(max_length=8, choices=DTYPES, default="BF16")
    kv_dtype = models.CharField(max_length=8, choices=KV_DTYPES, default="BF16")
    max_context = models.PositiveIntegerField(help_text="max_position_embeddings (tokens)")
    backend = models.CharField(max_length=16, choices=LIBRARY_BACKENDS, default="vllm")
    store_path = models.CharField(max_length=500, help_text="the weights' folder, relative to TESSERA_MODEL_STORE_ROOT")
    source_url = models.CharField(max_length=500, help_text="where the figures come from (config.json, model card)")
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["family", "params", "key"]
        constraints = [
            models.CheckConstraint(condition=models.Q(kv_heads__lte=models.F("attention_heads")),
                                   name="library_kv_heads_le_attention_heads"),
        ]

    def __str__(self) -> str:
        return self.name


class UploadState(models.TextChoices):
    """Where an uploaded repository or adapter is: the web request stores the archive (validating), a control
    worker unpacks and checks it (ready, or failed with a reason a tenant may read)."""

    VALIDATING = "validating", "Validating"
    READY = "ready", "Ready"
    FAILED = "failed", "Failed"


class ModelRepository(models.Model):
    """A tenant's own Triton model repository (uploaded archive or a model-store object): stored by the web request,
    unpacked and validated by a control worker under TESSERA_UPLOAD_ROOT (readable by the node workers)."""

    class Source(models.TextChoices):
        UPLOAD = "upload", "Uploaded archive"
        STORE = "store", "MSP model store"

    State = UploadState

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="model_repositories")
    name = models.CharField(max_length=64)
    source = models.CharField(max_length=8, choices=Source.choices)
    store_path = models.CharField(max_length=500, blank=True, help_text="for source=store: relative to the store")
    filename = models.CharField(max_length=255, blank=True)
    archive_bytes = models.PositiveBigIntegerField(default=0)
    archive_sha256 = models.CharField(max_length=64, blank=True)
    state = models.CharField(max_length=12, choices=UploadState.choices, default=UploadState.VALIDATING,
                             help_text="validating (a worker unpacks and checks it), ready (deployable) or failed")
    failure_reason = models.TextField(blank=True, help_text="why it failed (names files inside the archive only)")
    validated_at = models.DateTimeField(null=True, blank=True)
    size_bytes = models.PositiveBigIntegerField(default=0, help_text="expanded size")
    file_count = models.PositiveIntegerField(default=0)
    manifest = models.JSONField(default=list, blank=True,
                                help_text="its models, each: name, backend, max_batch_size, inputs, outputs, "
                                          "versions, size_bytes, memory_mb, steps")
    path = models.CharField(max_length=300, help_text="relative to TESSERA_UPLOAD_ROOT")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(default=timezone.now)

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "tenant_id"

    class Meta:
        ordering = ["-created_at"]
        verbose_name_plural = "model repositories"
        constraints = [models.UniqueConstraint(fields=["tenant", "name"], name="model_repository_name_per_tenant")]

    def __str__(self) -> str:
        return f"{self.name} ({self.tenant_id})"


class LoraAdapter(models.Model):
    """A tenant's LoRA adapter (PEFT layout) for a library base model, served by vLLM multi-LoRA on a deployment of
    that base model; stored and validated like a repository."""

    State = UploadState

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="lora_adapters")
    name = models.CharField(max_length=64, help_text="the name requests select it by (vLLM's lora_name)")
    base = models.ForeignKey(LibraryModel, on_delete=models.PROTECT, related_name="adapters")
    source = models.CharField(max_length=8, choices=ModelRepository.Source.choices)
    store_path = models.CharField(max_length=500, blank=True)
    filename = models.CharField(max_length=255, blank=True)
    archive_sha256 = models.CharField(max_length=64, blank=True)
    state = models.CharField(max_length=12, choices=UploadState.choices, default=UploadState.VALIDATING,
                             help_text="validating (a worker unpacks and checks it), ready (deployable) or failed")
    failure_reason = models.TextField(blank=True, help_text="why it failed (names files inside the archive only)")
    validated_at = models.DateTimeField(null=True, blank=True)
    rank = models.PositiveIntegerField(default=0, help_text="r of adapter_config.json (0 until validated)")
    target_modules = models.JSONField(default=list)
    size_bytes = models.PositiveBigIntegerField(default=0)
    file_count = models.PositiveIntegerField(default=0)
    path = models.CharField(max_length=300, help_text="relative to TESSERA_UPLOAD_ROOT")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(default=timezone.now)

    objects = TenantScopedQuerySet.as_manager()
    tenant_path = "tenant_id"

    class Meta:
        ordering = ["-created_at"]
        constraints = [models.UniqueConstraint(fields=["tenant", "name"], name="lora_adapter_name_per_tenant")]

    def __str__(self) -> str:
        return f"{self.name} on {self.base_id} ({self.tenant_id})"
