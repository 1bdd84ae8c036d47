from django.contrib import admin
from django.contrib.auth.admin import UserAdmin as BaseUserAdmin

from .lockout import LockoutAdminAuthenticationForm
from .models import ApiKey, AuditEvent, Invitation, Membership, Tenant, User

admin.site.login_form = LockoutAdminAuthenticationForm  # login lockout on /admin/login/ too


@admin.register(User)
class UserAdmin(BaseUserAdmin):
    ordering = ["email"]
    list_display = ["email", "full_name", "is_staff", "is_active", "last_login"]
    search_fields = ["email", "full_name"]
    fieldsets = [
        (None, {"fields": ["email", "password", "full_name"]}),
        ("Permissions", {"fields": ["is_active", "is_staff", "is_superuser", "groups", "user_permissions"]}),
        ("Dates", {"fields": ["last_login", "date_joined"]}),
    ]
    add_fieldsets = [(None, {"classes": ["wide"], "fields": ["email", "password1", "password2"]})]


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    raw_id_fields = ["user"]


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["name", "slug", "status", "currency", "monthly_spend_limit", "created_at"]
    list_filter = ["status", "currency"]
    search_fields = ["name", "slug", "billing_email"]
    inlines = [MembershipInline]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["name", "prefix", "tenant", "status", "created_at", "last_used_at", "expires_at"]
    list_filter = ["tenant"]
    search_fields = ["name", "prefix"]
    readonly_fields = ["prefix", "hashed_key", "last_used_at", "revoked_at", "revoked_by", "created_by"]

    def has_add_permission(self, request):  # keys are created through the API/portal (shown once)
        return False


@admin.register(Invitation)
class InvitationAdmin(admin.ModelAdmin):
    list_display = ["email", "tenant", "role", "status", "created_at", "expires_at"]
    readonly_fields = ["token_hash"]


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    """Read only: the audit log is written by the services, never edited."""

    list_display = ["at", "actor", "action", "target", "tenant"]
    list_filter = ["action", "tenant"]
    search_fields = ["actor", "target", "action"]
    date_hierarchy = "at"
    readonly_fields = ["at", "actor", "actor_user", "tenant", "action", "target", "detail"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
