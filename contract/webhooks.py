"""The webhook wire contract: which job transitions are announced, under which event names, and
the headers each delivery carries. A receiver checks the signature with the secret it registered:
``hmac.new(secret, body, sha256).hexdigest()`` against the header's value after ``sha256=``.
"""

from __future__ import annotations

#: The job state a transition reaches -> the event a webhook subscribes to.
EVENT_FOR_STATE: dict[str, str] = {
    "RUNNING": "job.running",
    "SUCCEEDED": "job.succeeded",
    "FAILED": "job.failed",
    "CANCELLED": "job.cancelled",
}
#: A job that stopped at a checkpoint boundary to make room for another (priority preemption).
PREEMPTED_EVENT = "job.preempted"
EVENTS: tuple[str, ...] = (*EVENT_FOR_STATE.values(), PREEMPTED_EVENT)

SIGNATURE_HEADER = "X-Zerotrain-Signature"  # "sha256=" + hex HMAC-SHA256 of the raw body
DELIVERY_HEADER = "X-Zerotrain-Delivery"  # the delivery's id: the same on every retry of it
EVENT_HEADER = "X-Zerotrain-Event"  # the event name, also in the body
SIGNATURE_PREFIX = "sha256="
