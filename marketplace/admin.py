from django.contrib import admin

from .models import Gpu, GpuInstance, GpuModel, MigPlacement, MigProfile, Node, ServerPlatform


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
    list_display = ["name", "key", "gpu_model", "gpu_count"]


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
