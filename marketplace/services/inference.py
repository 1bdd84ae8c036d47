"""Calling a tenant's model from the portal ("Try it"): through the inference gateway, like any client.

The signed-in user needs the ``infer`` capability on the model's tenant. No key is stored or shown: the portal
mints a short-lived signed token (``gateway.state.mint_try_token``) that the gateway accepts for that tenant
only, so what is tried is served, limited and metered exactly as an application's request would be.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from django.conf import settings

from marketplace.gateway.state import mint_try_token
from marketplace.models import ModelDeployment
from tenants.errors import Forbidden, ServiceError
from tenants.scoping import Principal

MAX_PROMPT_CHARS = 8000


def examples(dep: ModelDeployment, model: str | None = None) -> dict[str, str]:
    """Copy-paste calls for a model, with the key as a placeholder. ``model``: the name to call when it is not the
    deployment's own (a LoRA adapter served with it is called by the adapter's name)."""
    url, name = settings.TESSERA_GATEWAY_URL, model or dep.name
    return {
        "curl": (f"curl {url}/v1/chat/completions \\\n  -H \"Authorization: Bearer $TESSERA_API_KEY\" \\\n"
                 f"  -H \"Content-Type: application/json\" \\\n"
                 f"  -d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], "
                 f"\"max_tokens\": 32}}'"),
        "python": ("from openai import OpenAI\n\n"
                   f"client = OpenAI(base_url=\"{url}/v1\", api_key=\"<your key with the inference scope>\")\n"
                   f"reply = client.chat.completions.create(model=\"{name}\", max_tokens=32,\n"
                   "    messages=[{\"role\": \"user\", \"content\": \"Hello\"}])\n"
                   "print(reply.choices[0].message.content, reply.usage)"),
        "tritonclient": ("import numpy as np\nimport tritonclient.http as httpclient\n\n"
                         f"client = httpclient.InferenceServerClient(\"{url.split('://', 1)[-1]}\")\n"
                         "headers = {\"Authorization\": \"Bearer <your key with the inference scope>\"}\n"
                         "prompt = httpclient.InferInput(\"prompt\", [1, 1], \"BYTES\")\n"
                         "prompt.set_data_from_numpy(np.array([[b\"Hello\"]], dtype=np.object_))\n"
                         f"result = client.infer(\"{name}\", [prompt], headers=headers)\n"
                         "print(result.as_numpy(\"text\"))"),
    }


def try_prompt(principal: Principal, dep: ModelDeployment, prompt: str, max_tokens: int | None = 32) -> dict:
    """Send one prompt through the gateway for the signed-in user; returns text, usage and milliseconds."""
    if principal.user is None or not principal.can("infer", dep.tenant_id):
        raise Forbidden("Your role cannot call this tenant's models.")
    prompt = (prompt or "").strip()
    if not prompt:
        raise ServiceError("write a prompt", field="prompt")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ServiceError(f"at most {MAX_PROMPT_CHARS:,} characters", field="prompt")
    if max_tokens is not None and not 1 <= max_tokens <= 1024:
        raise ServiceError("between 1 and 1024", field="max_tokens")
    if dep.state != ModelDeployment.State.READY:
        raise ServiceError(f"the model is {dep.state}, not ready", field="prompt")
    token = mint_try_token(dep.tenant_id, principal.user.pk)
    body: dict[str, object] = {"model": dep.name, "messages": [{"role": "user", "content": prompt}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    req = urllib.request.Request(f"{settings.TESSERA_GATEWAY_INTERNAL_URL}/v1/chat/completions",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:  # the configured gateway URL
            answer = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = f"the gateway answered {exc.code}"
        raise ServiceError(message, field="prompt") from None
    except OSError:
        raise ServiceError("the inference gateway is not reachable right now", field="prompt") from None
    return {"text": answer["choices"][0]["message"]["content"], "usage": answer["usage"], "id": answer["id"],
            "ms": round((time.perf_counter() - started) * 1000, 1)}
