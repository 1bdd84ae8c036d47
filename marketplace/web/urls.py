from django.contrib.auth import views as auth_views
from django.shortcuts import redirect
from django.urls import include, path

from marketplace.web import invitations
from tenants import sso
from tenants.lockout import LockoutAuthenticationForm
from tenants.scoping import principal_for


def home(request):
    if not request.user.is_authenticated:
        return redirect("login")
    return redirect("console:overview" if principal_for(request).is_operator else "portal:home")


class Login(auth_views.LoginView):
    redirect_authenticated_user = True
    authentication_form = LockoutAuthenticationForm

    def get_context_data(self, **kwargs):
        from django.conf import settings

        return {**super().get_context_data(**kwargs), "sso": sso.enabled(),
                "sso_name": settings.TESSERA_OIDC_PROVIDER_NAME}


class Logout(auth_views.LogoutView):
    """Tessera's logout, then (an SSO session) the identity provider's (sso.provider_logout_url)."""

    def post(self, request, *args, **kwargs):
        provider = sso.provider_logout_url(request)
        response = super().post(request, *args, **kwargs)
        return redirect(provider) if provider else response


urlpatterns = [
    path("", home, name="home"),
    path("login/", Login.as_view(), name="login"),
    path("logout/", Logout.as_view(), name="logout"),
    path("oidc/authenticate/", sso.start, name="oidc_authentication_init"),
    path("oidc/callback/", sso.callback, name="oidc_authentication_callback"),
    path("password-reset/", auth_views.PasswordResetView.as_view(), name="password_reset"),
    path("password-reset/sent/", auth_views.PasswordResetDoneView.as_view(), name="password_reset_done"),
    path("password-reset/<uidb64>/<token>/", auth_views.PasswordResetConfirmView.as_view(),
         name="password_reset_confirm"),
    path("password-reset/done/", auth_views.PasswordResetCompleteView.as_view(), name="password_reset_complete"),
    path("invitations/<str:token>/", invitations.invitation, name="invitation"),
    path("console/", include(("marketplace.web.console_urls", "console"), namespace="console")),
    path("portal/", include(("marketplace.web.portal_urls", "portal"), namespace="portal")),
]
