from django.contrib.auth import views as auth_views
from django.shortcuts import redirect
from django.urls import include, path

from marketplace.web import invitations
from tenants.lockout import LockoutAuthenticationForm
from tenants.scoping import principal_for


def home(request):
    if not request.user.is_authenticated:
        return redirect("login")
    return redirect("console:overview" if principal_for(request).is_operator else "portal:home")


urlpatterns = [
    path("", home, name="home"),
    path("login/", auth_views.LoginView.as_view(
        redirect_authenticated_user=True, authentication_form=LockoutAuthenticationForm), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("password-reset/", auth_views.PasswordResetView.as_view(), name="password_reset"),
    path("password-reset/sent/", auth_views.PasswordResetDoneView.as_view(), name="password_reset_done"),
    path("password-reset/<uidb64>/<token>/", auth_views.PasswordResetConfirmView.as_view(),
         name="password_reset_confirm"),
    path("password-reset/done/", auth_views.PasswordResetCompleteView.as_view(), name="password_reset_complete"),
    path("invitations/<str:token>/", invitations.invitation, name="invitation"),
    path("console/", include(("marketplace.web.console_urls", "console"), namespace="console")),
    path("portal/", include(("marketplace.web.portal_urls", "portal"), namespace="portal")),
]
