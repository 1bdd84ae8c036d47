"""Tenants: users, tenants, memberships and roles, invitations, API keys, quotas, tenant scoping."""
