"""The Triton server of each slice: where it listens, as whom it runs, and what its supervisor saw.

The node worker starts one server per allocation (``services.serving``) and records it here; the web app
only reads these rows (the console's node and allocation pages). Ports come from the node's pool
(``Node.serving_port_min..serving_port_max``): a server holds three of them while it is not stopped, and
the unique constraints make two live servers on one node unable to share a port.
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from .fleet import Node
from .orders import Allocation


class TritonServer(models.Model):
    class State(models.TextChoices):
        STARTING = "starting", "Starting"
        RUNNING = "running", "Running"  # answered /v2/health/ready
        FAILED = "failed", "Failed"  # exited or never became ready; reason and log tail say why
        STOPPED = "stopped", "Stopped"  # stopped by Tessera (release); ports returned

    class Isolation(models.TextChoices):
        SANDBOX = "sandbox", "Sandbox (namespaces, firewall, cgroup, own Unix user)"
        USER = "user", "Own Unix user"  # servers started before the sandbox
        CONTAINER = "container", "Container"
        NONE = "none", "None (runs as the worker's user)"
        SIM = "sim", "Simulated"

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="triton_servers")
    allocation = models.OneToOneField(Allocation, on_delete=models.CASCADE, related_name="triton_server")
    runtime = models.CharField(max_length=16, help_text="process, docker or sim")
    state = models.CharField(max_length=16, choices=State.choices, default=State.STARTING)
    isolation = models.CharField(max_length=16, choices=Isolation.choices, default=Isolation.NONE)
    address = models.CharField(max_length=64, help_text="the node-private address it binds")
    http_port = models.PositiveIntegerField(null=True, blank=True)
    grpc_port = models.PositiveIntegerField(null=True, blank=True)
    metrics_port = models.PositiveIntegerField(null=True, blank=True)
    unix_user = models.CharField(max_length=32, blank=True)
    pid = models.IntegerField(null=True, blank=True)
    container_id = models.CharField(max_length=80, blank=True)
    nonce = models.CharField(max_length=64, blank=True,
                             help_text="per start; the repository-API secret is derived from it and SECRET_KEY")
    started_at = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    stopped_at = models.DateTimeField(null=True, blank=True)
    last_health_at = models.DateTimeField(null=True, blank=True)
    last_health_ok = models.BooleanField(null=True, blank=True)
    restarts = models.PositiveIntegerField(default=0)
    oom_kills = models.PositiveIntegerField(default=0, help_text="processes its sandbox's memory limit killed "
                                                                  "(since it started), as last seen by reconcile")
    pid_limit_hits = models.PositiveIntegerField(default=0, help_text="forks its sandbox's process limit refused "
                                                                       "(since it started), as last seen by reconcile")
    exit_code = models.IntegerField(null=True, blank=True)
    reason = models.CharField(max_length=1000, blank=True, help_text="operators only: why it failed or stopped")
    log_tail = models.TextField(blank=True, help_text="operators only: the end of the server's log")
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["node_id", "http_port", "pk"]
        constraints = [
            models.UniqueConstraint(fields=["node", "http_port"], name="triton_server_http_port_unique"),
            models.UniqueConstraint(fields=["node", "grpc_port"], name="triton_server_grpc_port_unique"),
            models.UniqueConstraint(fields=["node", "metrics_port"], name="triton_server_metrics_port_unique"),
        ]

    def __str__(self) -> str:
        return f"triton {self.name} on {self.node_id} ({self.state})"

    @property
    def name(self) -> str:
        return f"allocation-{self.allocation_id}"

    @property
    def uptime_s(self) -> float | None:
        if self.state != self.State.RUNNING or self.started_at is None:
            return None
        return (timezone.now() - self.started_at).total_seconds()
