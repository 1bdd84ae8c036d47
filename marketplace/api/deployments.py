"""Model deployments on a tenant's slices (tenant-scoped; scope deployments:write to change)."""

from __future__ import annotations

import django_filters
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from marketplace.models import Allocation, ModelDeployment
from marketplace.selectors import orders as selectors
from marketplace.services import deployments
from tenants.scoping import principal_for

from .viewsets import ScopedViewSetMixin


class ScopedAllocationField(serializers.PrimaryKeyRelatedField):
    def get_queryset(self):
        return Allocation.objects.visible_to(principal_for(self.context["request"]))


class DeploymentSerializer(serializers.ModelSerializer):
    allocation = ScopedAllocationField()
    name = serializers.RegexField(r"^[a-zA-Z0-9_-]{1,64}$", max_length=64)
    template = serializers.ChoiceField(choices=sorted(deployments.TEMPLATES), required=False, write_only=True,
                                       help_text="a ready-made model (tiny-gen: a small text generator)")
    spec = serializers.JSONField(required=False, help_text="ModelSpec: backend, max_batch_size, inputs, outputs, "
                                 "instance_group, dynamic_batching, version, files, parameters, memory_mb")
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)

    class Meta:
        model = ModelDeployment
        fields = ["id", "allocation", "tenant", "name", "template", "spec", "backend", "memory_mb", "state",
                  "waiting_reason", "failure_reason", "created_at", "updated_at", "ready_at"]
        read_only_fields = ["id", "tenant", "backend", "memory_mb", "state", "waiting_reason", "failure_reason",
                            "created_at", "updated_at", "ready_at"]
        validators = []

    def to_representation(self, obj):
        data = super().to_representation(obj)
        spec = dict(obj.spec)
        spec["files"] = sorted(spec.get("files", {}))  # names only in listings
        data["spec"] = spec
        return data


class DeploymentFilter(django_filters.FilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug")

    class Meta:
        model = ModelDeployment
        fields = ["tenant", "allocation", "state", "name"]


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
        dep = deployments.deploy(self.principal, data["allocation"], data["name"], template=data.get("template"),
                                 spec=data.get("spec"))
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


