"""Claims: e-mail (verified), name and the user's Django groups as `groups` (what an IdP's group claim carries)."""

from oauth2_provider.oauth2_validators import OAuth2Validator


class Validator(OAuth2Validator):
    oidc_claim_scope = {**OAuth2Validator.oidc_claim_scope, "groups": "profile"}

    def get_additional_claims(self, request):
        user = request.user
        return {"email": user.email, "email_verified": True, "name": user.get_full_name() or user.username,
                "groups": sorted(g.name for g in user.groups.all())}
