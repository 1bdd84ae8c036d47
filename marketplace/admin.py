from django.contrib import admin
from django.utils import timezone

from .models import (
    Allocation,
    AllocationEvent,
    BillingAlert,
    DriftEvent,
    Gpu,
    GpuInstance,
    GpuModel,
    LibraryModel,
    LoraAdapter,
    MigPlacement,
    MigProfile,
    ModelDeployment,
    ModelRepository,
    Node,
    Order,
    PricePlan,
    ServerPlatform,
    Tier,
    TritonServer,
)


class MigPlacementInline(admin.TabularInline):
    model = MigPlacement
    extra = 0


@admin.register(GpuModel)
class GpuModelAdmin(admin.ModelAdmin):
    list_display = ["name", "key", "memory_gb", "bandwidth_tbps", "tdp_watts", "fp8"]


@admin.register(MigProfile)
class MigProfileAdmin(admin.ModelAdmin):
    list_display = ["name", "gpu_model", "profile_id", "nvml_constant", "memory_slices", "compute_slices",
                    "memory_gb", "max_count"]
    list_filter = ["gpu_model"]
    inlines = [MigPlacementInline]


@admin.register(ServerPlatform)
class ServerPlatformAdmin(admin.ModelAdmin):
    list_display = ["name", "key", "vendor", "gpu_model", "gpu_count", "interconnect", "source_url"]
    list_filter = ["vendor", "gpu_model"]


class GpuInline(admin.TabularInline):
    model = Gpu
    extra = 0
    fields = ["index", "uuid", "gpu_model", "mig_mode", "state", "dedicated_tenant"]


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ["hostname", "platform", "queue", "state", "last_heartbeat"]
    list_filter = ["state", "platform"]
    search_fields = ["hostname"]
    inlines = [GpuInline]


@admin.register(Gpu)
class GpuAdmin(admin.ModelAdmin):
    list_display = ["__str__", "uuid", "gpu_model", "mig_mode", "state", "dedicated_tenant"]
    list_filter = ["gpu_model", "mig_mode", "state"]
    list_select_related = ["node", "gpu_model", "dedicated_tenant"]
    search_fields = ["uuid", "node__hostname"]


@admin.register(GpuInstance)
class GpuInstanceAdmin(admin.ModelAdmin):
    list_display = ["__str__", "tenant", "placement", "state", "mig_uuid", "created_at"]
    list_filter = ["state", "gpu__gpu_model"]
    list_select_related = ["gpu__node", "tenant", "placement__profile"]
    readonly_fields = ["reason"]


class PricePlanInline(admin.TabularInline):
    """The tier's plans, read only: a plan is added in the console (tier page) or the price-plan API, which check
    what a plan starting in the past may reprice (marketplace.services.offers.add_price_plan); one in force is
    never edited or removed."""

    model = PricePlan
    extra = 0
    fields = readonly_fields = ("kind", "currency", "price_per_slice_hour", "price_per_1m_input_tokens",
                                "price_per_1m_output_tokens", "monthly_commit", "effective_from", "created_at")

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Tier)
class TierAdmin(admin.ModelAdmin):
    list_display = ["name", "key", "gpu_model", "profile", "dedicated", "allowed_backends", "active"]
    list_filter = ["gpu_model", "active", "dedicated"]
    inlines = [PricePlanInline]


@admin.register(LibraryModel)
class LibraryModelAdmin(admin.ModelAdmin):
    """The MSP's model library: architectures for the memory fit, weights in the model store."""

    list_display = ["name", "key", "family", "params", "layers", "kv_heads", "head_dim", "weight_dtype", "kv_dtype",
                    "max_context", "backend", "active"]
    list_filter = ["family", "backend", "weight_dtype", "active"]
    search_fields = ["key", "name", "family"]


@admin.register(LoraAdapter)
class LoraAdapterAdmin(admin.ModelAdmin):
    list_display = ["name", "tenant", "base", "state", "rank", "size_bytes", "created_at"]
    list_filter = ["state", "base"]
    search_fields = ["name", "tenant__slug"]
    readonly_fields = ["tenant", "base", "source", "store_path", "filename", "archive_sha256", "state",
                       "failure_reason", "validated_at", "rank", "target_modules", "size_bytes", "file_count", "path",
                       "created_by", "created_at"]


@admin.register(ModelRepository)
class ModelRepositoryAdmin(admin.ModelAdmin):
    list_display = ["name", "tenant", "source", "state", "file_count", "size_bytes", "created_at"]
    list_filter = ["state", "source"]
    search_fields = ["name", "tenant__slug"]
    readonly_fields = ["tenant", "source", "store_path", "filename", "archive_bytes", "archive_sha256", "state",
                       "failure_reason", "validated_at", "size_bytes", "file_count", "manifest", "path", "created_by",
                       "created_at"]


class AllocationEventInline(admin.TabularInline):
    model = AllocationEvent
    extra = 0
    can_delete = False
    readonly_fields = ["from_state", "to_state", "actor", "reason", "detail", "at"]


@admin.register(Allocation)
class AllocationAdmin(admin.ModelAdmin):
    list_display = ["pk", "tenant", "tier", "state", "node", "mig_uuid", "updated_at"]
    list_filter = ["state", "tier", "node"]
    list_select_related = ["tenant", "tier", "node"]
    search_fields = ["mig_uuid", "gpu_uuid", "tenant__slug"]
    readonly_fields = [f.name for f in Allocation._meta.fields]
    inlines = [AllocationEventInline]


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):
    list_display = ["pk", "tenant", "tier", "quantity", "plan_kind", "created_at"]
    list_select_related = ["tenant", "tier"]


@admin.register(DriftEvent)
class DriftEventAdmin(admin.ModelAdmin):
    list_display = ["at", "node", "gpu_index", "kind", "detail", "resolved"]
    list_filter = ["kind", "resolved", "node"]


@admin.register(ModelDeployment)
class ModelDeploymentAdmin(admin.ModelAdmin):
    list_display = ["name", "tenant", "allocation", "backend", "memory_mb", "state", "updated_at"]
    list_filter = ["state", "backend"]


@admin.register(TritonServer)
class TritonServerAdmin(admin.ModelAdmin):
    """What the node workers recorded about each slice's Triton server: read-only (the worker owns it)."""

    list_display = ["allocation", "node", "state", "isolation", "address", "http_port", "restarts",
                    "last_health_ok", "last_health_at"]
    list_filter = ["state", "isolation", "runtime", "node"]
    list_select_related = ["allocation", "node"]
    readonly_fields = [f.name for f in TritonServer._meta.fields if f.name != "nonce"]
    exclude = ["nonce"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(BillingAlert)
class BillingAlertAdmin(admin.ModelAdmin):
    """Billing problems an operator must act on (usage with no price in the invoice's currency, a
    tenant's rating or finalization failing in the beat); resolved by the next successful run. Refused
    usage (unsigned or forged events that claimed the tenant) is resolved here, by the action below."""

    list_display = ["at", "tenant", "period_start", "kind", "message", "resolved_at", "resolution"]
    list_filter = ["kind", "resolved_at"]
    list_select_related = ["tenant"]
    readonly_fields = ["tenant", "period_start", "kind", "message", "at", "resolved_at", "resolution"]
    actions = ["resolve_refused_usage"]

    @admin.action(description="Resolve the selected refused-usage alerts (looked into)", permissions=["change"])
    def resolve_refused_usage(self, request, queryset) -> None:
        """Refused usage (unsigned or forged events) has no next run to resolve it: an operator does, after
        looking; the next refusal opens a new alert."""
        n = queryset.filter(kind=BillingAlert.Kind.REFUSED_USAGE, resolved_at__isnull=True).update(
            resolved_at=timezone.now(), resolution=f"looked into by {request.user}"[:300])
        self.message_user(request, f"{n} refused-usage alert(s) resolved.")

    def has_add_permission(self, request) -> bool:
        return False
