"""Shared REST API pieces: pagination, error handling, the scoped viewset base, the router."""
