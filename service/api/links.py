"""OpenAPI links: which later call takes a value from an answer (``POST /jobs`` -> the job's id).

Why: a client generator or a stateful tester reads them to chain calls the way a user does
(submit, then follow, cancel, read the logs of *that* job), instead of guessing ids. One table
here; each route's decorator asks for its entry with ``links_for(operation, status)``.
"""

from __future__ import annotations

from typing import Any

JOB_ID = "$response.body#/id"
_JOB_FOLLOW_UPS = ("get_job", "cancel_job", "list_job_events", "get_job_logs", "list_metrics",
                   "list_checkpoints", "job_metrics_chart")

# (operation id, status) -> {link name: (target operation id, {parameter: runtime expression})}
LINKS: dict[tuple[str, int], dict[str, tuple[str, dict[str, str]]]] = {
    ("submit_job", 201): {target: (target, {"job_id": JOB_ID}) for target in _JOB_FOLLOW_UPS},
    ("get_job", 200): {target: (target, {"job_id": JOB_ID}) for target in _JOB_FOLLOW_UPS if target != "get_job"},
    ("create_token", 201): {"revoke_token": ("revoke_token", {"token_id": "$response.body#/id"})},
    ("create_webhook", 201): {target: (target, {"webhook_id": "$response.body#/id"})
                              for target in ("list_webhook_deliveries", "delete_webhook")},
    ("upload_code_package", 201): {"get_code_package": ("get_code_package", {"sha256": "$response.body#/sha256"})},
}


def links_for(operation: str, status: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` entry that adds this operation's links to its ``status`` answer."""
    links = {name: {"operationId": target, "parameters": parameters}
             for name, (target, parameters) in LINKS[(operation, status)].items()}
    return {status: {"links": links}}
