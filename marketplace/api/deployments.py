"""Model deployments on a tenant's slices (tenant-scoped; scope deployments:write to change)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from drf_spectacular.extensions import OpenApiSerializerFieldExtension
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from marketplace.filters import DeploymentFilter
from marketplace.hardware import triton
from marketplace.models import Allocation, LibraryModel, LoraAdapter, ModelDeployment, ModelRepository
from marketplace.selectors import orders as selectors
from marketplace.services import deployments
from tenants.scoping import principal_for

from .viewsets import ScopedViewSetMixin

if TYPE_CHECKING:
    from rest_framework.validators import Validator

    from tenants.models import Tenant


class ScopedAllocationField(serializers.PrimaryKeyRelatedField):
    def get_queryset(self):
        return Allocation.objects.visible_to(principal_for(self.context["request"]))


class ScopedAdapterField(serializers.PrimaryKeyRelatedField):
    def get_queryset(self):
        return LoraAdapter.objects.visible_to(principal_for(self.context["request"]))


class ScopedRepositoryField(serializers.PrimaryKeyRelatedField):
    def get_queryset(self):
        return ModelRepository.objects.visible_to(principal_for(self.context["request"]))


class TensorSpecSerializer(serializers.Serializer):
    name = serializers.CharField(help_text="letters, digits, _ . : / -; starts with a letter or _")
    data_type = serializers.ChoiceField(choices=list(triton.DATA_TYPES))
    dims = serializers.ListField(child=serializers.IntegerField(min_value=-1), min_length=1,
                                 help_text="positive integers or -1 (variable); [1] for a scalar")
    optional = serializers.BooleanField(default=False, help_text="inputs only")


class InstanceGroupSerializer(serializers.Serializer):
    count = serializers.IntegerField(min_value=1, max_value=64, default=1)
    kind = serializers.ChoiceField(choices=list(triton.INSTANCE_KINDS), default="KIND_GPU")
    gpus = serializers.ListField(child=serializers.IntegerField(min_value=0), required=False, allow_null=True,
                                 help_text="KIND_GPU only; a slice is always device 0")


class DynamicBatchingSerializer(serializers.Serializer):
    preferred_batch_size = serializers.ListField(child=serializers.IntegerField(min_value=1), default=list)
    max_queue_delay_microseconds = serializers.IntegerField(min_value=0, default=0)


class ModelSpecSerializer(serializers.Serializer):
    """A full model spec (what Tessera renders into config.pbtxt and the version folder)."""

    backend = serializers.ChoiceField(choices=list(triton.BACKENDS))
    max_batch_size = serializers.IntegerField(min_value=0, default=0, help_text="0: no batching")
    inputs = TensorSpecSerializer(many=True, required=False)
    outputs = TensorSpecSerializer(many=True, required=False)
    instance_group = InstanceGroupSerializer(required=False)
    dynamic_batching = DynamicBatchingSerializer(required=False, allow_null=True)
    version = serializers.IntegerField(min_value=1, default=1)
    files = serializers.DictField(child=serializers.CharField(), required=False,
                                  help_text="path relative to the version folder -> content (at most 2 MiB in all)")
    parameters = serializers.DictField(child=serializers.CharField(), required=False)
    memory_mb = serializers.IntegerField(min_value=1, help_text="declared memory need on the slice, runtime included")
    decoupled = serializers.BooleanField(default=False, help_text="model_transaction_policy { decoupled: true }: any "
                                         "number of responses per request (streamed by the gateway)")


class ModelSpecField(serializers.JSONField):
    """Validated by ModelSpec itself (its messages name the field). In requests its schema is
    ModelSpecSerializer's; in responses it is the stored spec (see StoredSpecSchema)."""


class ModelSpecFieldSchema(OpenApiSerializerFieldExtension):
    """Requests: a full ModelSpec. Responses: what Tessera stored — a ModelSpec with its files by name only,
    or for a repository's or library model ``kind`` (upload | library), the model folders and, for a library
    model, the fit and the adapters."""

    target_class = "marketplace.api.deployments.ModelSpecField"

    def map_serializer_field(self, auto_schema, direction):
        if direction == "request":
            return auto_schema.resolve_serializer(ModelSpecSerializer, direction).ref
        return {"type": "object", "additionalProperties": True, "description": (
            "the stored spec: a ModelSpec with `files` as the list of file names; or `kind` \"upload\" "
            "(repository, model, models) or \"library\" (library_model, models, fit, adapters, files by name)")}


class DeploymentSerializer(serializers.ModelSerializer):
    allocation = ScopedAllocationField()
    name = serializers.RegexField(r"^[a-zA-Z0-9_-]{1,64}$", max_length=64, required=False,
                                  help_text="the Triton model name (a repository's model keeps its own)")
    template = serializers.ChoiceField(choices=sorted(deployments.TEMPLATES), required=False, write_only=True,
                                       help_text="a ready-made model (tiny-gen: a small text generator)")
    spec = ModelSpecField(required=False, help_text="a full model spec (instead of template, repository or "
                                                    "library_model)")
    repository = ScopedRepositoryField(required=False, allow_null=True,
                                       help_text="one of your model repositories (id): deploys its model; it must be "
                                                 "ready (409 while it is validating or when it failed)")
    model = serializers.CharField(required=False, write_only=True, max_length=64,
                                  help_text="with repository: which of its models (default: its only model or "
                                            "its ensemble)")
    library_model = serializers.SlugRelatedField(slug_field="key", required=False, allow_null=True,
                                                 queryset=LibraryModel.objects.filter(active=True),
                                                 help_text="a model of the MSP's library (key): Tessera writes its "
                                                           "vLLM / TensorRT-LLM repository from the fit")
    # A declared field: DRF's metaclass takes it off the class; the stubs see it replace Field.context.
    context = serializers.IntegerField(  # type: ignore[assignment]
        required=False, min_value=0, max_value=10**7, default=0,
        help_text="library models: max context in tokens (0: the longest that fits)")
    concurrency = serializers.IntegerField(required=False, min_value=1, max_value=100_000, default=1,
                                           help_text="library models: concurrent sequences the cache is sized for")
    adapters = ScopedAdapterField(many=True, required=False,
                                  help_text="with library_model: your LoRA adapters for it (ids), served by vLLM "
                                            "multi-LoRA (a request selects one with the lora_name parameter)")
    declared_memory_mb = serializers.IntegerField(required=False, write_only=True, min_value=1,
                                                  help_text="repositories: memory need (default: the configs' "
                                                            "tessera_memory_mb, else the files' size)")
    tenant: serializers.SlugRelatedField[Tenant] = serializers.SlugRelatedField(slug_field="slug", read_only=True)

    class Meta:
        model = ModelDeployment
        fields = ["id", "allocation", "tenant", "name", "template", "spec", "repository", "model", "library_model",
                  "adapters", "context", "concurrency", "declared_memory_mb", "backend", "memory_mb", "state",
                  "waiting_reason", "failure_reason", "created_at", "updated_at", "ready_at"]
        read_only_fields = ["id", "tenant", "backend", "memory_mb", "state", "waiting_reason", "failure_reason",
                            "created_at", "updated_at", "ready_at"]
        validators: list[Validator[dict[str, object]]] = []

    def validate(self, attrs):
        sources = [k for k in ("template", "spec", "repository", "library_model") if attrs.get(k)]
        if len(sources) > 1:
            raise serializers.ValidationError({sources[1]: [f"give one of template, spec, repository, library_model "
                                                            f"(got {', '.join(sources)})"]})
        if not attrs.get("repository") and not attrs.get("name"):
            raise serializers.ValidationError({"name": ["This field is required."]})
        return attrs

    def to_representation(self, obj):
        data = super().to_representation(obj)
        spec = dict(obj.spec)
        spec["files"] = sorted(spec.get("files", {}))  # names only in listings
        spec.pop("path", None)  # where the node reads an uploaded repository: not the tenant's business
        data["spec"] = spec
        return data


class DeploymentViewSet(ScopedViewSetMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                        mixins.CreateModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet):
    """Triton models on the tenant's slices. Create writes the slice's model repository and loads it
    (state pending -> loading -> ready; while the slice's server is not up the model stays pending with a
    ``waiting_reason``, and fails after TESSERA_DEPLOY_WAIT_S); DELETE unloads and removes it; retry loads a
    failed one again."""

    queryset_model = ModelDeployment
    selector = selectors.deployments
    serializer_class = DeploymentSerializer
    filterset_class = DeploymentFilter
    search_fields = ["name"]
    ordering_fields = ["created_at", "name", "state"]
    ordering = ["-created_at"]
    capabilities = {"create": "deploy", "destroy": "deploy", "retry": "deploy"}

    def create(self, request, *args, **kwargs):
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        dep = deployments.deploy(self.principal, data["allocation"], data.get("name", ""),
                                 template=data.get("template"), spec=data.get("spec"),
                                 repository=data.get("repository"), model=data.get("model"),
                                 library_model=data.get("library_model"), context=data.get("context", 0),
                                 concurrency=data.get("concurrency", 1),
                                 memory_mb=data.get("declared_memory_mb", 0), adapters=data.get("adapters"))
        return Response(self.get_serializer(dep).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={202: DeploymentSerializer})
    def destroy(self, request, *args, **kwargs):
        dep = deployments.remove(self.principal, self.get_object())
        return Response(self.get_serializer(dep).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: DeploymentSerializer})
    @action(detail=True, methods=["post"])
    def retry(self, request, pk=None):
        """Load a failed model again (its slice's server was down, or the cause is fixed): state -> pending."""
        dep = deployments.retry(self.principal, self.get_object())
        return Response(self.get_serializer(dep).data, status=status.HTTP_202_ACCEPTED)


