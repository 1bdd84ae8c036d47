"""Catalog (any signed-in principal) and fleet (operators; tenants see their own instances)."""

from __future__ import annotations

from typing import ClassVar

from rest_framework import mixins, serializers, viewsets

from marketplace.filters import GpuFilter, InstanceFilter, MigProfileFilter, NodeFilter
from marketplace.models import Gpu, GpuInstance, GpuModel, MigProfile, Node, ServerPlatform
from marketplace.selectors import catalog as selectors
from marketplace.services import fleet
from tenants.models import Tenant
from tenants.permissions import SharedRead

from .disclosure import OperatorOnlyFieldsMixin
from .viewsets import ScopedReadOnlyViewSet, ScopedViewSetMixin


class GpuModelSerializer(serializers.ModelSerializer):
    class Meta:
        model = GpuModel
        fields = ["id", "key", "name", "nvml_name", "pci_device_id", "memory_gb", "memory_mib", "bandwidth_tbps",
                  "tdp_watts", "sm_count", "fp8", "memory_slices", "compute_slices", "max_gpu_instances"]


class MigProfileSerializer(serializers.ModelSerializer):
    gpu_model: serializers.SlugRelatedField[GpuModel] = serializers.SlugRelatedField(slug_field="key", read_only=True)
    starts = serializers.SerializerMethodField()

    class Meta:
        model = MigProfile
        fields = ["id", "gpu_model", "name", "nvml_constant", "profile_id", "memory_slices", "compute_slices",
                  "memory_gb", "memory_mib", "sm_count", "max_count", "media_extensions", "starts"]

    def get_starts(self, obj) -> list[int]:
        return [p.start for p in obj.placements.all()]


class ServerPlatformSerializer(serializers.ModelSerializer):
    gpu_model: serializers.SlugRelatedField[GpuModel] = serializers.SlugRelatedField(slug_field="key", read_only=True)

    class Meta:
        model = ServerPlatform
        fields = ["id", "key", "name", "gpu_model", "gpu_count"]


class CatalogViewSet(viewsets.ReadOnlyModelViewSet):
    permission_classes = [SharedRead]


class GpuModelViewSet(CatalogViewSet):
    """GPU models sold (H100 SXM 80GB, H200 SXM 141GB) with NVIDIA's figures."""

    queryset = selectors.gpu_models()
    serializer_class = GpuModelSerializer
    filterset_fields = ["key", "fp8"]
    ordering_fields = ["memory_gb", "key"]
    lookup_field = "key"


class MigProfileViewSet(CatalogViewSet):
    """MIG GPU-instance profiles per GPU model, with legal placement starts (memory slices)."""

    queryset = selectors.mig_profiles()
    serializer_class = MigProfileSerializer
    filterset_class = MigProfileFilter
    ordering_fields = ["memory_slices", "compute_slices", "memory_gb"]


class ServerPlatformViewSet(CatalogViewSet):
    queryset = selectors.platforms()
    serializer_class = ServerPlatformSerializer
    lookup_field = "key"


# --- fleet ---------------------------------------------------------------------------------------

class NodeSerializer(serializers.ModelSerializer):
    platform: serializers.SlugRelatedField[ServerPlatform] = serializers.SlugRelatedField(slug_field="key",
                                                                                         read_only=True)
    gpu_count = serializers.IntegerField(read_only=True)
    used_slots = serializers.IntegerField(read_only=True)

    class Meta:
        model = Node
        fields = ["id", "hostname", "platform", "queue", "state", "last_heartbeat", "gpu_count", "used_slots",
                  "serving_address", "serving_port_min", "serving_port_max"]
        read_only_fields = ["id", "hostname", "queue", "last_heartbeat"]


class SlotInstanceSerializer(OperatorOnlyFieldsMixin, serializers.ModelSerializer):
    tenant: serializers.SlugRelatedField[Tenant] = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    profile = serializers.CharField(source="placement.profile.name", default="whole GPU", read_only=True)
    start = serializers.IntegerField(read_only=True, allow_null=True, help_text="operators only (null for tenants)")
    reason = serializers.CharField(read_only=True, help_text="operators only (blank for tenants): why the engine "
                                   "chose this GPU and start")
    operator_only: ClassVar = {"start": None, "gi_id": None, "ci_id": None, "reason": ""}

    class Meta:
        model = GpuInstance
        fields = ["id", "tenant", "profile", "start", "size", "state", "gi_id", "ci_id", "mig_uuid", "reason"]


class GpuSerializer(serializers.ModelSerializer):
    node: serializers.SlugRelatedField[Node] = serializers.SlugRelatedField(slug_field="hostname", read_only=True)
    gpu_model: serializers.SlugRelatedField[GpuModel] = serializers.SlugRelatedField(slug_field="key", read_only=True)
    dedicated_tenant: serializers.SlugRelatedField[Tenant] = serializers.SlugRelatedField(slug_field="slug",
                                                                                          read_only=True)
    used_slots = serializers.IntegerField(read_only=True)
    instances = SlotInstanceSerializer(many=True, read_only=True)
    slot_map = serializers.SerializerMethodField(help_text="tenant slug (or null) for each memory slice 0..7")

    class Meta:
        model = Gpu
        fields = ["id", "node", "index", "uuid", "gpu_model", "mig_mode", "state", "dedicated_tenant",
                  "used_slots", "slot_map", "instances"]

    def get_slot_map(self, obj) -> list[str | None]:
        slots: list[str | None] = [None] * 8
        for inst in obj.instances.all():
            for s in inst.slot_range:
                slots[s] = inst.tenant.slug
        return slots


class NodeViewSet(ScopedViewSetMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.UpdateModelMixin,
                  viewsets.GenericViewSet):
    """GPU nodes (operators): PATCH changes a node's state (draining, maintenance) and its serving port pool."""

    queryset_model = Node
    selector = selectors.nodes
    serializer_class = NodeSerializer
    filterset_class = NodeFilter
    search_fields = ["hostname"]
    ordering_fields = ["hostname", "state", "last_heartbeat"]
    ordering = ["hostname"]
    http_method_names = ["get", "patch", "head", "options"]
    capabilities = {"list": "operate", "retrieve": "operate", "partial_update": "operate"}

    def perform_update(self, serializer):
        serializer.instance = fleet.update_node(self.principal, serializer.instance, **serializer.validated_data)


class GpuViewSet(ScopedReadOnlyViewSet):
    """GPUs with their MIG slot map (operators)."""

    queryset_model = Gpu
    selector = selectors.gpus
    serializer_class = GpuSerializer
    filterset_class = GpuFilter
    search_fields = ["uuid", "node__hostname"]
    ordering_fields = ["node__hostname", "index", "used_slots"]
    ordering = ["node__hostname", "index"]
    capabilities = {"list": "operate", "retrieve": "operate"}


class GpuInstanceSerializer(SlotInstanceSerializer):
    """Tenants list their own instances: profile, size, state and MIG device, not where they run."""

    gpu = serializers.CharField(source="gpu.uuid", read_only=True, allow_null=True,
                                help_text="the GPU's UUID; operators only (null for tenants)")
    node = serializers.CharField(source="gpu.node.hostname", read_only=True, allow_null=True,
                                 help_text="operators only (null for tenants)")
    gpu_model = serializers.CharField(source="gpu.gpu_model.key", read_only=True)
    operator_only: ClassVar = {**SlotInstanceSerializer.operator_only, "gpu": None, "node": None}

    class Meta(SlotInstanceSerializer.Meta):
        fields = [*SlotInstanceSerializer.Meta.fields, "gpu", "node", "gpu_model", "created_at"]


class GpuInstanceViewSet(ScopedReadOnlyViewSet):
    """GPU instances (MIG slices and whole GPUs): operators see all, tenants their own."""

    queryset_model = GpuInstance
    selector = selectors.gpu_instances
    serializer_class = GpuInstanceSerializer
    filterset_class = InstanceFilter
    ordering_fields = ["created_at", "start"]
    ordering = ["-created_at"]
