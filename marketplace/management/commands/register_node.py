"""`manage.py register_node --platform hgx-h100-8 [--hostname H]`: run on a GPU host (or with the
simulated backend) to register it and its GPUs as NVML reports them; prints the queue its worker
must consume."""

from __future__ import annotations

import socket

from django.core.management.base import BaseCommand, CommandError

from marketplace.models import ServerPlatform
from marketplace.services import fleet
from marketplace.services.catalog import sync_catalog
from tenants.errors import ServiceError


class Command(BaseCommand):
    help = "Register this GPU node (discovered through NVML) and print its Celery queue."

    def add_arguments(self, parser):
        parser.add_argument("--platform", required=True, help="server platform key, e.g. hgx-h100-8")
        parser.add_argument("--hostname", default=socket.gethostname())

    def handle(self, *args, platform, hostname, **opts):
        sync_catalog()
        try:
            plat = ServerPlatform.objects.select_related("gpu_model").get(key=platform)
        except ServerPlatform.DoesNotExist:
            keys = ", ".join(ServerPlatform.objects.values_list("key", flat=True))
            raise CommandError(f"unknown platform {platform!r}; one of: {keys}") from None
        from django.conf import settings

        if settings.TESSERA_NVML_BACKEND == "sim":
            from marketplace.services.nodes import sim_discovery

            gpus = sim_discovery(hostname, plat)
        else:
            from marketplace.hardware.nvml import NvmlClient, get_backend

            with NvmlClient(get_backend("pynvml")) as client:
                gpus = fleet.discover(client)
        try:
            node = fleet.register_node(hostname, plat, gpus)
        except ServiceError as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(f"registered {node.hostname}: {len(gpus)} x {plat.gpu_model.name}")
        self.stdout.write(f"start its worker: TESSERA_NODE_HOSTNAME={node.hostname} celery -A marketplace worker "
                          f"-Q {node.queue} -c 1 -n {node.hostname}@%h")
