"""Models on slices: a tenant's own Triton repositories (multipart upload or a model-store object), the MSP's
model library with its fit per tier, and "find a tier"."""

from __future__ import annotations

from typing import TYPE_CHECKING

from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import mixins, permissions, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.parsers import FormParser, JSONParser, MultiPartParser
from rest_framework.response import Response
from rest_framework.views import APIView

from marketplace import fit
from marketplace.models import LibraryModel, LoraAdapter, ModelRepository
from marketplace.selectors import models as sel
from marketplace.services import models as model_svc
from tenants.api.serializers import ScopedTenantField
from tenants.errors import ServiceError
from tenants.scoping import principal_for

from .viewsets import ScopedViewSetMixin

if TYPE_CHECKING:
    from rest_framework.validators import Validator


class TensorSerializer(serializers.Serializer):
    name = serializers.CharField()
    data_type = serializers.CharField(help_text="TYPE_FP32, TYPE_STRING, ...")
    dims = serializers.ListField(child=serializers.IntegerField())


class ManifestModelSerializer(serializers.Serializer):
    name = serializers.CharField()
    backend = serializers.ChoiceField(choices=list(model_svc.model_repo.KNOWN_BACKENDS))
    max_batch_size = serializers.IntegerField()
    inputs = TensorSerializer(many=True)
    outputs = TensorSerializer(many=True)
    versions = serializers.ListField(child=serializers.IntegerField())
    size_bytes = serializers.IntegerField()
    memory_mb = serializers.IntegerField(help_text="declared with the tessera_memory_mb parameter (0: none)")
    steps = serializers.ListField(child=serializers.CharField(), help_text="an ensemble's composing models")


class ModelRepositorySerializer(serializers.ModelSerializer):
    tenant = ScopedTenantField(required=False, help_text="tenant slug (API keys: their own tenant)")
    archive = serializers.FileField(write_only=True, required=False,
                                    help_text="a Triton model repository as .tar.gz or .zip (multipart); at most "
                                              "TESSERA_UPLOAD_MAX_BYTES")
    store_path = serializers.CharField(required=False, allow_blank=True, max_length=500,
                                       help_text="instead of an archive: a folder or archive in the MSP's model "
                                                 "store, relative to its root")
    manifest = ManifestModelSerializer(many=True, read_only=True,
                                       help_text="its models (empty until the repository is ready)")
    url = serializers.HyperlinkedIdentityField(view_name="api:modelrepository-detail",
                                               help_text="poll it while the state is validating")

    class Meta:
        model = ModelRepository
        fields = ["id", "url", "tenant", "name", "source", "archive", "store_path", "filename", "archive_bytes",
                  "archive_sha256", "state", "failure_reason", "validated_at", "size_bytes", "file_count", "manifest",
                  "created_at"]
        read_only_fields = ["id", "source", "filename", "archive_bytes", "archive_sha256", "state", "failure_reason",
                            "validated_at", "size_bytes", "file_count", "created_at"]
        extra_kwargs = {"state": {"help_text": "validating (a worker unpacks and checks the archive), ready "
                                               "(deployable) or failed (see failure_reason)"},
                        "failure_reason": {"help_text": "why validation failed; names files inside the archive"}}
        validators: list[Validator[dict[str, object]]] = []

    def validate(self, attrs):
        principal = principal_for(self.context["request"])
        if "tenant" not in attrs:
            if principal.key_tenant_id is None:
                raise serializers.ValidationError({"tenant": ["This field is required."]})
            attrs["tenant"] = principal.api_key.tenant
        if bool(attrs.get("archive")) == bool(attrs.get("store_path")):
            raise serializers.ValidationError({"archive": ["give an archive or a store_path (one of them)"]})
        return attrs


def accepted(data) -> Response:
    """202: stored, a worker validates it; poll ``url`` (also the ``Location`` header)."""
    # str(): the serializer's url is DRF's Hyperlink (a str subclass), which WSGI servers refuse in a header
    return Response(data, status=status.HTTP_202_ACCEPTED, headers={"Location": str(data["url"])})


class ModelRepositoryViewSet(ScopedViewSetMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                             mixins.CreateModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet):
    """A tenant's own Triton model repositories. Create: multipart with ``archive`` (tar.gz or zip) or JSON with
    ``store_path``. The request stores the archive and answers 202 with the repository ``validating`` and its
    ``url`` (also in ``Location``); what the archive's headers show at once (names that are not UTF-8, paths
    leaving the archive, links, devices, too many files, a declared expanded size or a config.pbtxt over the
    limits) is a 400 naming the file. A control worker then unpacks it within the limits and validates it
    (each config.pbtxt with Triton's schema, backends, one device, every file a config names inside the model,
    no host paths): ``ready``, or ``failed`` with ``failure_reason`` naming the file. Deploy a model of a ready
    repository with ``POST /api/v1/deployments/`` and ``repository`` (409 while it is not ready)."""

    queryset_model = ModelRepository
    selector = sel.repositories
    serializer_class = ModelRepositorySerializer
    parser_classes = [MultiPartParser, FormParser, JSONParser]
    filterset_fields = ["source", "name", "state"]
    search_fields = ["name"]
    ordering_fields = ["created_at", "name"]
    ordering = ["-created_at"]
    capabilities = {"create": "deploy", "destroy": "deploy"}

    @extend_schema(responses={202: ModelRepositorySerializer})
    def create(self, request, *args, **kwargs):
        s = self.get_serializer(data=request.data)
        s.is_valid(raise_exception=True)
        d = s.validated_data
        if d.get("archive"):
            repo = model_svc.upload_repository(self.principal, d["tenant"], d["name"], d["archive"])
        else:
            repo = model_svc.import_from_store(self.principal, d["tenant"], d["name"], d["store_path"])
        return accepted(self.get_serializer(repo).data)

    def destroy(self, request, *args, **kwargs):
        model_svc.delete_repository(self.principal, self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


class LoraAdapterSerializer(serializers.ModelSerializer):
    tenant = ScopedTenantField(required=False, help_text="tenant slug (API keys: their own tenant)")
    base = serializers.SlugRelatedField(slug_field="key", queryset=LibraryModel.objects.filter(active=True),
                                        help_text="the library model it was trained on (key)")
    archive = serializers.FileField(write_only=True, required=False,
                                    help_text="PEFT's adapter_config.json + adapter_model.safetensors as .tar.gz or "
                                              ".zip (multipart)")
    store_path = serializers.CharField(required=False, allow_blank=True, max_length=500,
                                       help_text="instead of an archive: its folder in the MSP's model store")
    url = serializers.HyperlinkedIdentityField(view_name="api:loraadapter-detail",
                                               help_text="poll it while the state is validating")

    class Meta:
        model = LoraAdapter
        fields = ["id", "url", "tenant", "name", "base", "source", "archive", "store_path", "filename",
                  "archive_sha256", "state", "failure_reason", "validated_at", "rank", "target_modules", "size_bytes",
                  "file_count", "created_at"]
        read_only_fields = ["id", "source", "filename", "archive_sha256", "state", "failure_reason", "validated_at",
                            "rank", "target_modules", "size_bytes", "file_count", "created_at"]
        extra_kwargs = ModelRepositorySerializer.Meta.extra_kwargs
        validators: list[Validator[dict[str, object]]] = []

    validate = ModelRepositorySerializer.validate


class LoraAdapterViewSet(ScopedViewSetMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                         mixins.CreateModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet):
    """A tenant's LoRA adapters for library base models. Create answers 202 with the adapter ``validating`` (a
    control worker unpacks and checks it, like a repository: then ``ready`` or ``failed``). Deploy ready ones with
    their base model (``POST /api/v1/deployments/`` with ``library_model`` and ``adapters``): vLLM multi-LoRA,
    each adapter selected by its name; the fit counts their memory."""

    queryset_model = LoraAdapter
    selector = sel.adapters
    serializer_class = LoraAdapterSerializer
    parser_classes = [MultiPartParser, FormParser, JSONParser]
    filterset_fields = ["source", "name", "state"]
    search_fields = ["name"]
    ordering_fields = ["created_at", "name"]
    ordering = ["-created_at"]
    capabilities = {"create": "deploy", "destroy": "deploy"}

    @extend_schema(responses={202: LoraAdapterSerializer})
    def create(self, request, *args, **kwargs):
        s = self.get_serializer(data=request.data)
        s.is_valid(raise_exception=True)
        d = s.validated_data
        if d.get("archive"):
            ad = model_svc.upload_adapter(self.principal, d["tenant"], d["name"], d["base"], d["archive"])
        else:
            ad = model_svc.adapter_from_store(self.principal, d["tenant"], d["name"], d["base"], d["store_path"])
        return accepted(self.get_serializer(ad).data)

    def destroy(self, request, *args, **kwargs):
        model_svc.delete_adapter(self.principal, self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


class LibraryModelSerializer(serializers.ModelSerializer):
    weights_mib = serializers.SerializerMethodField()
    kv_cache_bytes_per_token = serializers.SerializerMethodField()

    class Meta:
        model = LibraryModel
        fields = ["id", "key", "name", "family", "params", "layers", "hidden_size", "attention_heads", "kv_heads",
                  "head_dim", "weight_dtype", "kv_dtype", "max_context", "backend", "source_url", "active",
                  "weights_mib", "kv_cache_bytes_per_token"]

    def get_weights_mib(self, obj) -> int:
        return round(model_svc.library_shape(obj).weights_bytes / fit.MIB)

    def get_kv_cache_bytes_per_token(self, obj) -> int:
        return model_svc.library_shape(obj).kv_bytes_per_token


class TierFitSerializer(serializers.Serializer):
    tier = serializers.CharField()
    tier_name = serializers.CharField()
    gpu_model = serializers.CharField()
    profile = serializers.CharField(allow_null=True)
    memory_mib = serializers.IntegerField(help_text="the allocation's memory (a multi-GPU tier: all its GPUs')")
    gpu_count = serializers.IntegerField(help_text="whole GPUs per allocation (tensor parallel size); 1: one slice "
                                                   "or GPU. needed_mib and headroom_mib are per GPU")
    fits = serializers.BooleanField()
    reason = serializers.CharField()
    needed_mib = serializers.IntegerField()
    headroom_mib = serializers.IntegerField()
    max_cached_tokens = serializers.IntegerField()
    max_context = serializers.IntegerField()
    max_concurrency = serializers.IntegerField()
    currency = serializers.CharField(allow_null=True)
    price_per_hour = serializers.CharField(allow_null=True)
    price_per_1m_input_tokens = serializers.CharField(allow_null=True)
    price_per_1m_output_tokens = serializers.CharField(allow_null=True)
    tokens_per_s = serializers.FloatField()
    tokens_per_s_source = serializers.CharField(help_text="measured (planner) or modelled, and how")
    cost_per_1m_tokens = serializers.CharField(allow_null=True, help_text="slice-hours at full load per 1M tokens "
                                               "+ the plan's token prices (input_share of input tokens)")


class FindTierSerializer(serializers.Serializer):
    library_model = serializers.SlugRelatedField(slug_field="key", queryset=LibraryModel.objects.filter(active=True),
                                                 required=False, help_text="a library model (key)")
    repository = serializers.IntegerField(required=False, help_text="one of your model repositories (id)")
    memory_mib = serializers.IntegerField(required=False, min_value=1, max_value=10**7,
                                          help_text="or: a model of this size (MiB) without a KV cache")
    backend = serializers.ChoiceField(choices=list(model_svc.model_repo.KNOWN_BACKENDS), default="python",
                                      help_text="with memory_mib: its backend (runtime overhead)")
    # A declared field: DRF's metaclass takes it off the class; the stubs see it replace Field.context.
    context = serializers.IntegerField(  # type: ignore[assignment]
        min_value=0, max_value=10**7, default=0, help_text="tokens per sequence (0: the model's max context)")
    concurrency = serializers.IntegerField(min_value=1, max_value=100_000, default=1)
    currency = serializers.CharField(default="USD", max_length=3)
    input_share = serializers.FloatField(min_value=0, max_value=1, default=0.5)
    all = serializers.BooleanField(default=False, help_text="also list the tiers it does not fit")

    def validate(self, attrs):
        given = [k for k in ("library_model", "repository", "memory_mib") if attrs.get(k) is not None]
        if len(given) != 1:
            raise serializers.ValidationError({"library_model": ["give one of library_model, repository, memory_mib"]})
        return attrs


def shape_from(principal, d) -> fit.ModelShape:
    if d.get("library_model") is not None:
        m = d["library_model"]
        if d["context"] > m.max_context:
            raise ServiceError(f"context {d['context']:,} exceeds {m.name}'s max context of {m.max_context:,} tokens",
                               field="context")
        return model_svc.library_shape(m)
    if d.get("repository") is not None:
        repo = sel.repositories(principal).filter(pk=d["repository"]).first()
        if repo is None:
            raise ServiceError("no such repository", field="repository")
        model_svc.require_ready(repo, "repository")
        _top, names = model_svc.pick_model(repo, None) if len(repo.manifest) else (None, [])
        return model_svc.repository_shape(repo, names)
    return fit.ModelShape(name=f"{d['memory_mib']:,} MiB model", backend=d["backend"], fixed_mib=d["memory_mib"])


def find(principal, d) -> list[dict]:
    shape = shape_from(principal, d)
    return [o.as_dict() for o in sel.find_tiers(shape, context=d["context"], concurrency=d["concurrency"],
                                                currency=d["currency"], input_share=d["input_share"],
                                                fitting_only=not d["all"])]


class LibraryModelViewSet(viewsets.ReadOnlyModelViewSet):
    """The MSP's model library (operators curate it in the admin). ``fit/``: the model on every tier."""

    serializer_class = LibraryModelSerializer
    permission_classes = [permissions.IsAuthenticated]
    filterset_fields = ["family", "backend", "weight_dtype"]
    search_fields = ["key", "name", "family"]
    ordering_fields = ["params", "name", "key"]
    ordering = ["family", "params"]

    def get_queryset(self):
        return sel.library()

    @extend_schema(parameters=[OpenApiParameter("context", int), OpenApiParameter("concurrency", int),
                               OpenApiParameter("currency", str)],
                   responses={200: TierFitSerializer(many=True)})
    @action(detail=True, methods=["get"], pagination_class=None, filter_backends=[])
    def fit(self, request, pk=None):
        """This model on every active tier (fits or not): memory needed, headroom, the largest context x
        concurrency, price, tokens/s and cost per 1M tokens."""
        s = FindTierSerializer(data={**request.query_params.dict(), "library_model": self.get_object().key,
                                     "all": True})
        s.is_valid(raise_exception=True)
        return Response(find(principal_for(request), s.validated_data))


class FindTierView(APIView):
    """Find a tier: every active tier a model fits at a context length and concurrency, cheapest per 1M tokens
    first, with the price per hour, expected tokens/s (measured where the planner has a figure, else modelled,
    labelled) and the expected cost per 1M tokens. Order one with ``POST /api/v1/orders/``."""

    permission_classes = [permissions.IsAuthenticated]

    @extend_schema(request=FindTierSerializer, responses={200: inline_serializer(
        "FindTierResult", {"tiers": TierFitSerializer(many=True)})})
    def post(self, request):
        s = FindTierSerializer(data=request.data)
        s.is_valid(raise_exception=True)
        return Response({"tiers": find(principal_for(request), s.validated_data)})
