"""A real OpenID Connect provider for the SSO tests: django-oauth-toolkit's, in its own Django project and its own
process (``python -m tests.oidc_provider.serve``), with a sign-in form, a `groups` claim and RP-initiated logout.
Nothing of Tessera runs in it."""
