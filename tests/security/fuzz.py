"""One schemathesis operation fuzzed with hypothesis against a live server, failures collected (not a test
module): shared by the REST API's and the gateway's schema fuzzing."""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, given, settings


def fuzz_operation(op, path_parameters, tag: str, *, base_url: str, secret: str, checks: list, max_examples: int,
                   failures: list[str], cases: dict, mode=None) -> None:
    """Fuzz ``op`` (``path_parameters`` pinned, or generated when None); each failing operation adds one line to
    ``failures`` (with a curl to reproduce it); ``cases["n"]`` counts the calls made."""
    key = f"{op.method.upper()} {op.path}{tag}"
    strategy = (op.as_strategy(path_parameters=path_parameters) if mode is None
                else op.as_strategy(generation_mode=mode, path_parameters=path_parameters))

    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def one_case(case):
        cases["n"] += 1
        response = case.call(base_url=base_url, headers={"Authorization": f"Bearer {secret}"}, timeout=30)
        try:
            case.validate_response(response, checks=checks)
        except Exception as exc:  # collect every failing operation, report all
            text = " | ".join(line for line in str(exc).splitlines()[:12] if line.strip())
            failures.append(f"{key}: {type(exc).__name__}: {text}\n    curl: {case.as_curl_command()}")
            raise

    try:
        one_case()
    except BaseException as exc:  # FailureGroup is a BaseExceptionGroup
        if isinstance(exc, KeyboardInterrupt):
            raise
        if not any(f.startswith(f"{key}:") for f in failures):
            failures.append(f"{key}: {type(exc).__name__}: {exc}")
