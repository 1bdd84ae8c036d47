"""Celery tasks: thin wrappers around services. Node tasks are sent to the node's own queue
(`node.<hostname>`) by the services, after the transaction commits."""

from __future__ import annotations

import logging

from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.utils import timezone

from marketplace.hardware import model_repo
from marketplace.services import alerting, billing, deployments, provisioning, reconcile, webhooks
from marketplace.services import models as model_svc

log = logging.getLogger("tessera.tasks")

NODE_TASK = {
    "acks_late": True,
    "reject_on_worker_lost": True,
    "time_limit": 300,
    "soft_time_limit": 240,
}


@shared_task(bind=True, name="tessera.provision_allocation", autoretry_for=(provisioning.TransientProvisioningError,),
             retry_backoff=2, retry_backoff_max=120, retry_jitter=True, max_retries=6, **NODE_TASK)
def provision_allocation(self, allocation_id: int) -> str:
    return provisioning.provision(allocation_id, final_attempt=self.request.retries >= self.max_retries)


@shared_task(bind=True, name="tessera.release_allocation", autoretry_for=(Exception,), retry_backoff=2,
             retry_backoff_max=120, max_retries=6, **NODE_TASK)
def release_allocation(self, allocation_id: int) -> str:
    return provisioning.release_allocation(allocation_id)


@shared_task(name="tessera.reconcile_node", **NODE_TASK)
def reconcile_node(node_id: int) -> dict:
    return reconcile.reconcile_node(node_id)


@shared_task(name="tessera.reconcile_fleet", acks_late=True, time_limit=120)
def reconcile_fleet() -> int:
    """Beat (control queue): fan out one reconcile per ready node, each on its own queue."""
    return reconcile.fan_out()


DEPLOY_WAIT_POLL_S = 5


@shared_task(bind=True, name="tessera.deploy_model", autoretry_for=(OSError,), retry_backoff=2, max_retries=5,
             **NODE_TASK)
def deploy_model(self, deployment_id: int) -> str:
    try:
        return deployments.load(deployment_id)
    except deployments.WaitingForServer as exc:  # load() fails the model itself after TESSERA_DEPLOY_WAIT_S
        raise self.retry(exc=exc, countdown=DEPLOY_WAIT_POLL_S, max_retries=None) from None


@shared_task(bind=True, name="tessera.undeploy_model", autoretry_for=(OSError,), retry_backoff=2, max_retries=5,
             **NODE_TASK)
def undeploy_model(self, deployment_id: int) -> str:
    return deployments.unload(deployment_id)


# The webhooks queue's tasks (settings.CELERY_TASK_ROUTES): never on the control queue's workers. An attempt ends
# by its own deadline (TESSERA_WEBHOOK_TIMEOUT_S); the time limits are a backstop, after which the sweep retries it.
WEBHOOK_TASK = {
    "acks_late": True,
    "ignore_result": True,
    "soft_time_limit": settings.TESSERA_WEBHOOK_TIMEOUT_S + 20,
    "time_limit": settings.TESSERA_WEBHOOK_TIMEOUT_S + 30,
}


@shared_task(name="tessera.deliver_webhook", **WEBHOOK_TASK)
def deliver_webhook(delivery_id: int) -> str:
    """One attempt; the service queues the next one itself (backoff) and gives up after the last."""
    return webhooks.deliver(delivery_id)


@shared_task(name="tessera.sweep_webhooks", **WEBHOOK_TASK)
def sweep_webhooks() -> int:
    """Beat: queue again the deliveries whose next attempt is overdue (a lost message, a killed worker)."""
    return webhooks.sweep()


@shared_task(name="tessera.send_alerts", acks_late=True, ignore_result=True, time_limit=120)
def send_alerts() -> int:
    """Beat (control): the alarm set to Alertmanager, or mailed/POSTed without it. Returns how many fire."""
    return alerting.send(timezone.now()).firing


@shared_task(name="tessera.rate_and_check_spend", acks_late=True, time_limit=300)
def rate_and_check_spend() -> int:
    """Beat (control): open missing invoices and fan out one tessera.rate_tenant per tenant; the last
    one finalizes the months that ended and records the run's summary. Returns the run's id."""
    return billing.start_rating_run().pk


@shared_task(bind=True, name="tessera.rate_tenant", acks_late=True, time_limit=300, max_retries=3)
def rate_tenant(self, run_id: int, tenant_id: int) -> str:
    """Rate one tenant of a rating run and check its spend; retried on its own (backoff), its last
    failure alerted."""
    try:
        return billing.rate_run_tenant(run_id, tenant_id, final_attempt=self.request.retries >= self.max_retries)
    except Exception as exc:
        raise self.retry(exc=exc, countdown=min(300, 10 * 2 ** self.request.retries)) from exc


# Uploads: the web request stored the archive; a control worker unpacks and validates it within
# TESSERA_REPO_MAX_UNPACK_SECONDS (its own clock), Celery's soft limit a minute later as the backstop.
UPLOAD_TASK = {
    "acks_late": True,
    "reject_on_worker_lost": True,
    "autoretry_for": (model_repo.StorageError,),
    "retry_backoff": 5,
    "retry_backoff_max": 120,
    "max_retries": 3,
    "soft_time_limit": settings.TESSERA_REPO_MAX_UNPACK_SECONDS + 60,
    "time_limit": settings.TESSERA_REPO_MAX_UNPACK_SECONDS + 120,
}


def _validate(task, kind: str, pk: int) -> str:
    try:
        return model_svc.validate(kind, pk, final_attempt=task.request.retries >= task.max_retries)
    except model_repo.StorageError:
        raise  # retried; failed on the final attempt by validate()
    except SoftTimeLimitExceeded:
        model_svc.fail_validation(kind, pk, "unpacking and checking it took too long (the time limit)")
        return "failed"
    except Exception:  # never left "validating": the tenant sees a failure, the operators the traceback
        log.exception("upload validation crashed", extra={"kind": kind, "id": pk})
        model_svc.fail_validation(kind, pk, model_svc.INTERNAL_FAILURE)
        return "failed"


@shared_task(bind=True, name="tessera.validate_repository", **UPLOAD_TASK)
def validate_repository(self, repository_id: int) -> str:
    """Control queue: unpack and validate an uploaded (or model-store) repository -> ready or failed."""
    return _validate(self, "repository", repository_id)


@shared_task(bind=True, name="tessera.validate_adapter", **UPLOAD_TASK)
def validate_adapter(self, adapter_id: int) -> str:
    """Control queue: unpack and validate an uploaded (or model-store) LoRA adapter -> ready or failed."""
    return _validate(self, "adapter", adapter_id)
