"""Services enqueue Celery tasks by name through here, so that no service imports marketplace.tasks
(tasks import services, never the reverse)."""

from __future__ import annotations

from marketplace.celery import app

PROVISION_ALLOCATION = "tessera.provision_allocation"
RELEASE_ALLOCATION = "tessera.release_allocation"
RECONCILE_NODE = "tessera.reconcile_node"
DEPLOY_MODEL = "tessera.deploy_model"
UNDEPLOY_MODEL = "tessera.undeploy_model"
DELIVER_WEBHOOK = "tessera.deliver_webhook"
RATE_TENANT = "tessera.rate_tenant"
VALIDATE_REPOSITORY = "tessera.validate_repository"
VALIDATE_ADAPTER = "tessera.validate_adapter"


def send(task_name: str, args: list, queue: str, countdown: float | None = None) -> None:
    """Queue `task_name` (a registered task's name) with positional `args` on `queue`, to run no sooner than
    `countdown` seconds from now when given."""
    options = {} if countdown is None else {"countdown": countdown}
    app.send_task(task_name, args=args, queue=queue, **options)
