"""``GET /api/v1/``: the API's collections, as links (what a person or a client finds at the root)."""

from __future__ import annotations

from django.urls import get_resolver, reverse
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response
from rest_framework.views import APIView


def collection_names() -> list[str]:
    """The URL names of the API's list routes (``api:<name>-list``), in URL order."""
    api = get_resolver().namespace_dict["api"][1]
    names = []
    for name, _ in sorted(((n, v) for n, v in api.reverse_dict.items() if isinstance(n, str) and n.endswith("-list")),
                          key=lambda item: item[0]):
        names.append(name)
    return names


class ApiRootView(APIView):
    """Links to every collection of the REST API v1, the schema and the docs (signed in or with a key; each
    collection answers for the caller's own tenants)."""

    permission_classes = [IsAuthenticated]

    @extend_schema(responses={200: inline_serializer("ApiRoot", {
        "collections": serializers.DictField(child=serializers.URLField()),
        "schema": serializers.URLField(), "docs": serializers.URLField()})})
    def get(self, request):
        links = {name.removesuffix("-list"): request.build_absolute_uri(reverse(f"api:{name}"))
                 for name in collection_names()}
        return Response({"collections": links, "schema": request.build_absolute_uri(reverse("schema")),
                         "docs": request.build_absolute_uri(reverse("api-docs"))})
