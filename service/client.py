"""Python SDK for the zerotrain API (depends on httpx and pydantic only).

    from service.client import Client
    client = Client()                          # ZEROTRAIN_URL / ZEROTRAIN_TOKEN, else the local defaults
    job = client.submit(spec, idempotency_key="run-1")
    job = client.wait(job.id, timeout=600)

Every HTTP error becomes a typed exception carrying the server's message (``ZerotrainError``
and its subclasses); connection failures are ``ServiceUnavailable``.

[Note: replicas] The URL may name several replicas, comma-separated (``contract.environment.api_urls``).
A call that cannot reach one goes to the next when that is safe (``Client._send``); a dropped
event stream resumes on the next one with ``Last-Event-ID`` (``Client._follow``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from contract.environment import HOME_ENV, TOKEN_ENV, URL_ENV, api_urls
from contract.quotas import TeamQuota, TeamQuotaOut
from service.client_errors import (  # noqa: F401 -- re-exported: the SDK's exceptions are its API
    Conflict,
    NotFound,
    PayloadTooLarge,
    ServerError,
    ServiceUnavailable,
    Unauthorized,
    ValidationFailed,
    WaitTimeout,
    ZerotrainError,
    error_from_response,
)
from service.schemas import (
    LOG_SIZE_HEADER,
    SSE_KEEPALIVE_S,
    TERMINAL_STATES,
    CheckpointList,
    CheckpointOut,
    CodePackageOut,
    EventList,
    EventOut,
    JobOut,
    JobPage,
    JobSpec,
    JobState,
    MetricList,
    MetricPoint,
    TeamList,
    TeamMemberList,
    TeamMemberOut,
    TeamOut,
    TensorBoardOut,
    TokenCreated,
    TokenList,
    TokenOut,
    WebhookDeliveryList,
    WebhookDeliveryOut,
    WebhookList,
    WebhookOut,
)

DEFAULT_URL = "http://127.0.0.1:8000"


def _default_home() -> Path:
    return Path(os.environ.get(HOME_ENV) or "~/.zerotrain").expanduser()


def default_token() -> str | None:
    token = os.environ.get(TOKEN_ENV)
    if token:
        return token
    token_file = _default_home() / "token"
    try:
        return token_file.read_text().strip() or None
    except OSError:
        return None


def default_url() -> str:
    return (os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")


STREAM_RECONNECT_S = 120.0  # how long a broken event stream is tried again before raising
STREAM_BACKOFF_MAX_S = 10.0  # the longest wait between two reconnection attempts


RETRY_AFTER_BUDGET_S = 60.0  # the most one call waits on Retry-After answers before raising


def _retry_after(response: httpx.Response) -> float | None:
    """The seconds a 429/503 asks the client to wait (``Retry-After`` in seconds), else None."""
    if response.status_code not in (429, 503):
        return None
    try:
        return max(0.0, float(response.headers["Retry-After"]))
    except (KeyError, ValueError):  # absent, or an HTTP date: not waited on
        return None


def _safe_to_repeat(method: str, kwargs: dict[str, Any]) -> bool:
    """Whether sending the request again cannot do anything twice: it reads, or it carries an
    ``Idempotency-Key``."""
    headers = {k.lower() for k in (kwargs.get("headers") or {})}
    return method.upper() in ("GET", "HEAD") or "idempotency-key" in headers


def _repeatable(method: str, response: httpx.Response, kwargs: dict[str, Any]) -> bool:
    return response.status_code == 429 or _safe_to_repeat(method, kwargs)


_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)  # no connection: the request never left


class Client:
    def __init__(self, url: str | None = None, token: str | None = None, *, timeout: float = 30.0,
                 transport: httpx.BaseTransport | None = None):
        """``url``: the service, or several replicas of it comma-separated ([Note: replicas])."""
        self.urls = api_urls(url or default_url())
        if not self.urls:
            raise ZerotrainError(f"no zerotrain URL in {url!r} (one URL, or several comma-separated)")
        self._current = 0  # index into self.urls of the replica that answered last
        self.token = token or default_token()
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self._http = httpx.Client(headers=headers, timeout=timeout, transport=transport)

    @property
    def url(self) -> str:
        """The replica this client talks to now."""
        return self.urls[self._current]

    def _next_replica(self) -> None:
        self._current = (self._current + 1) % len(self.urls)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One API call. A 429 or 503 that says ``Retry-After`` is tried again after that many
        seconds, up to ``RETRY_AFTER_BUDGET_S`` of waiting in all, when repeating it is safe: the
        server refused it before doing anything (429), or it reads, or it carries an
        ``Idempotency-Key``; then the last answer is raised as usual. A replica that cannot be
        reached is left for the next (``_send``)."""
        waited = 0.0
        while True:
            response = self._send(method, path, **kwargs)
            delay = _retry_after(response)
            if delay is None or waited + delay > RETRY_AFTER_BUDGET_S or not _repeatable(method, response, kwargs):
                break
            time.sleep(delay)
            waited += delay
        if response.status_code >= 400:
            raise error_from_response(response)
        return response

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """``method`` on ``path`` at the current replica, else at the next ones in turn: at once
        after a connection that could not be made, and after any other transport error when the
        request is safe to repeat (one that may have arrived is not sent twice)."""
        problems = []
        for _ in self.urls:
            try:
                return self._http.request(method, self.url + path, **kwargs)
            except httpx.TransportError as error:
                problems.append(f"{self.url}: {error or type(error).__name__}")
                if not isinstance(error, _NOT_SENT) and not _safe_to_repeat(method, kwargs):
                    break
                self._next_replica()
        raise ServiceUnavailable(f"cannot reach zerotrain ({'; '.join(problems)})") from None

    def _api(self, method: str, path: str, **kwargs: Any) -> Any:
        return self.request(method, f"/api/v1{path}", **kwargs).json()

    # ------------------------------------------------------------------ jobs

    def submit(self, spec: JobSpec | dict[str, Any], idempotency_key: str | None = None) -> JobOut:
        body = spec.model_dump(mode="json") if isinstance(spec, JobSpec) else spec
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return JobOut.model_validate(self._api("POST", "/jobs", json=body, headers=headers))

    def get(self, job_id: str) -> JobOut:
        return JobOut.model_validate(self._api("GET", f"/jobs/{job_id}"))

    def list(self, state: JobState | str | None = None, limit: int = 50,
             cursor: str | None = None) -> JobPage:
        params: dict[str, Any] = {"limit": limit}
        if state is not None:
            params["state"] = JobState(state).value
        if cursor is not None:
            params["cursor"] = cursor
        return JobPage.model_validate(self._api("GET", "/jobs", params=params))

    def iterate(self, state: JobState | str | None = None, page_size: int = 100) -> Iterator[JobOut]:
        cursor = None
        while True:
            page = self.list(state=state, limit=page_size, cursor=cursor)
            yield from page.items
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    def cancel(self, job_id: str) -> JobOut:
        return JobOut.model_validate(self._api("POST", f"/jobs/{job_id}/cancel"))

    def events(self, job_id: str) -> list[EventOut]:
        return EventList.model_validate(self._api("GET", f"/jobs/{job_id}/events")).items

    def logs(self, job_id: str, tail_bytes: int | None = None, rank: int | None = None) -> str:
        """The job's log; with ``rank``, only that rank's lines (422 naming ``rank`` for a rank
        the job does not have)."""
        params = {key: value for key, value in {"tail_bytes": tail_bytes, "rank": rank}.items() if value is not None}
        return self.request("GET", f"/api/v1/jobs/{job_id}/logs", params=params).text

    def follow_logs(self, job_id: str, tail_bytes: int | None = None, poll: float = 1.0,
                    rank: int | None = None) -> Iterator[str]:
        """Yield the job's log (``rank``'s lines only, with it) as it grows -- first what there is (its last ``tail_bytes``), then
        each new part -- and return once the job has ended and its whole log was yielded.

        [Note: following by offset] Each poll asks for the log from the size the last answer
        reported (``offset``, the ``LOG_SIZE_HEADER``), so only the new part travels. A log
        that shrank (a new attempt's driver) is answered whole by the service and yielded whole;
        an empty answer after text (a log not readable for a moment) is skipped. The job's state
        is read before the log, so the read after the job ended is the complete log and the last one.
        """
        offset: int | None = None
        while True:
            ended = self.get(job_id).state in TERMINAL_STATES
            params = {key: value for key, value in {"rank": rank, "offset": offset}.items() if value is not None}
            response = self.request("GET", f"/api/v1/jobs/{job_id}/logs", params=params)
            size = int(response.headers.get(LOG_SIZE_HEADER, len(response.content)))
            text = response.text
            if offset is None:
                yield text.encode()[-tail_bytes:].decode(errors="replace") if tail_bytes else text
                offset = size
            elif size or not offset:
                if text:
                    yield text
                offset = size
            if ended:
                return
            time.sleep(poll)

    def checkpoints(self, job_id: str) -> list[CheckpointOut]:
        return CheckpointList.model_validate(self._api("GET", f"/jobs/{job_id}/checkpoints")).items

    def tensorboard(self, job_id: str) -> TensorBoardOut:
        """Where the job's TensorBoard event files are (the folder for ``tensorboard --logdir``)."""
        return TensorBoardOut.model_validate(self._api("GET", f"/jobs/{job_id}/tensorboard"))

    # ------------------------------------------------------------------ code packages

    def code_package(self, sha256: str) -> CodePackageOut | None:
        """Your uploaded package with this sha256, or None when you have not uploaded it."""
        try:
            return CodePackageOut.model_validate(self._api("GET", f"/code-packages/{sha256}"))
        except NotFound:
            return None

    def upload_code(self, data: bytes) -> CodePackageOut:
        """Upload a zip of your code (``service.code_packages.build_package`` makes one) once:
        when the service already holds these bytes of yours, nothing is sent. Its ``uri`` is the
        value for ``runtime.working_dir``."""
        import hashlib

        known = self.code_package(hashlib.sha256(data).hexdigest())
        if known is not None:
            return known
        return CodePackageOut.model_validate(self._api(
            "POST", "/code-packages", content=data, headers={"Content-Type": "application/octet-stream"},
            timeout=httpx.Timeout(self._http.timeout.connect, read=300, write=300, pool=30)))

    # ------------------------------------------------------------------ API tokens

    def create_token(self, name: str | None = None, *, is_admin: bool = False,
                     expires_in_days: float | None = None) -> TokenCreated:
        """A new token (yours by default); ``.token`` is the secret, shown this once."""
        body = {"name": name, "is_admin": is_admin, "expires_in_days": expires_in_days}
        return TokenCreated.model_validate(self._api("POST", "/tokens", json=body))

    def tokens(self, name: str | None = None) -> list[TokenOut]:
        params = {"name": name} if name else {}
        return TokenList.model_validate(self._api("GET", "/tokens", params=params)).items

    def revoke_token(self, token_id: int) -> TokenOut:
        return TokenOut.model_validate(self._api("DELETE", f"/tokens/{token_id}"))

    def create_webhook(self, url: str, events: list[str], secret: str, team: str | None = None) -> WebhookOut:
        """Have ``url`` told about your jobs' ``events`` (``contract.webhooks``), signed with ``secret``;
        given ``team``, about every job of that team (its maintainers and admins)."""
        body = {"url": url, "events": events, "secret": secret} | ({"team": team} if team is not None else {})
        return WebhookOut.model_validate(self._api("POST", "/webhooks", json=body))

    def webhooks(self) -> list[WebhookOut]:
        """Your webhooks and those of the teams you manage."""
        return WebhookList.model_validate(self._api("GET", "/webhooks")).items

    def delete_webhook(self, webhook_id: int) -> WebhookOut:
        return WebhookOut.model_validate(self._api("DELETE", f"/webhooks/{webhook_id}"))

    def webhook_deliveries(self, webhook_id: int, limit: int = 100) -> list[WebhookDeliveryOut]:
        """The webhook's newest deliveries first: status, attempts and the last answer of each."""
        answer = self._api("GET", f"/webhooks/{webhook_id}/deliveries", params={"limit": limit})
        return WebhookDeliveryList.model_validate(answer).items

    def create_team(self, name: str) -> TeamOut:
        """A new team (admins only); add its maintainers with ``set_team_member``."""
        return TeamOut.model_validate(self._api("POST", "/teams", json={"name": name}))

    def teams(self) -> list[TeamOut]:
        """The teams you are in, with your role in each."""
        return TeamList.model_validate(self._api("GET", "/teams")).items

    def team_members(self, team: str) -> list[TeamMemberOut]:
        return TeamMemberList.model_validate(self._api("GET", f"/teams/{team}/members")).items

    def set_team_member(self, team: str, user: str, role: str) -> TeamMemberOut:
        """Add ``user`` to ``team`` as ``role`` (viewer, member, maintainer), or change their role."""
        return TeamMemberOut.model_validate(self._api("POST", f"/teams/{team}/members",
                                                      json={"user": user, "role": role}))

    def remove_team_member(self, team: str, user: str) -> TeamMemberOut:
        return TeamMemberOut.model_validate(self._api("DELETE", f"/teams/{team}/members/{user}"))

    def team_quota(self, team: str) -> TeamQuotaOut:
        """The team's quota (``contract.quotas``) and what its jobs hold now."""
        return TeamQuotaOut.model_validate(self._api("GET", f"/teams/{team}/quota"))

    def set_team_quota(self, team: str, quota: TeamQuota | None = None, **bounds: float | None) -> TeamQuotaOut:
        """Replace the team's quota (admins): ``quota``, or its fields as keywords (``gpus``, ``cpus``,
        ``running_jobs``, ``max_priority``, ``share``); a bound left out is off."""
        body = (quota or TeamQuota()).model_dump() | bounds
        return TeamQuotaOut.model_validate(self._api("PUT", f"/teams/{team}/quota", json=body))

    def wait(self, job_id: str, timeout: float | None = None, poll: float = 0.5) -> JobOut:
        """Poll until the job is terminal; ``WaitTimeout`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.get(job_id)
            if job.state in TERMINAL_STATES:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"job {job_id} is still {job.state.value} after {timeout} s")
            time.sleep(poll if deadline is None else max(0.0, min(poll, deadline - time.monotonic())))

    # ------------------------------------------------------------------ metrics

    def metrics(self, job_id: str, rank: int | None = None, step_min: int | None = None,
                step_max: int | None = None, *, attempt: int | None = None, after_id: int | None = None,
                max_points: int | None = None, limit: int | None = None) -> list[MetricPoint]:
        """Stored records ordered by step and rank (by storage id when ``after_id`` is given)."""
        params = {key: value for key, value in {
            "rank": rank, "step_min": step_min, "step_max": step_max, "attempt": attempt,
            "after_id": after_id, "max_points": max_points, "limit": limit}.items() if value is not None}
        return MetricList.model_validate(self._api("GET", f"/jobs/{job_id}/metrics", params=params)).items

    def stream_metrics(self, job_id: str, after_id: int = 0, rank: int | None = None,
                       timeout: float | None = None, *,
                       reconnect_s: float = STREAM_RECONNECT_S) -> Iterator[MetricPoint]:
        """Yield metric records as they are stored; returns when the job has ended. A dropped
        connection or a restarted server is reconnected to (``_follow``)."""
        params: dict[str, Any] = {"after_id": after_id}
        if rank is not None:
            params["rank"] = rank
        return self._follow(f"/jobs/{job_id}/metrics/stream", params, "metric", MetricPoint, timeout, reconnect_s)

    def stream_events(self, job_id: str, after_id: int = 0, timeout: float | None = None, *,
                      reconnect_s: float = STREAM_RECONNECT_S) -> Iterator[EventOut]:
        """Yield the job's state changes as they happen (the earlier ones first); returns when
        the job has ended. Reconnects as ``stream_metrics`` does."""
        return self._follow(f"/jobs/{job_id}/events/stream", {"after_id": after_id}, "job_event", EventOut,
                            timeout, reconnect_s)

    def _follow(self, path: str, params: dict[str, Any], kind: str, model: type[Any],
                timeout: float | None, reconnect_s: float) -> Iterator[Any]:
        """The ``kind`` events of one server-sent event stream, across reconnections.

        [Note: resuming a stream] Each event's ``id:`` is remembered; after a dropped
        connection, a stream closed before its ``end`` event, a stream silent for ``timeout``
        seconds (default: three keep-alive intervals) or a 429/503, the request is made again
        with ``Last-Event-ID``, so the server goes on with the next event: no duplicate, no gap.
        Each new try goes to the next replica when there are several: every replica serves
        the same rows under the same ids (one database), so a stream opened on a replica that
        died goes on from another. The waits start at the stream's ``retry:`` (or a ``Retry-After``) and double up to
        ``STREAM_BACKOFF_MAX_S``; after ``reconnect_s`` seconds without an event or a keep-alive,
        ``ServiceUnavailable`` is raised.
        """
        last_id: str | None = None
        retry_s, failures, failing_since = 1.0, 0, time.monotonic()
        read_s = timeout if timeout is not None else 3 * SSE_KEEPALIVE_S
        while True:
            headers = {"Last-Event-ID": last_id} if last_id is not None else {}
            wait: float | None = None
            try:
                with self._http.stream("GET", f"{self.url}/api/v1{path}", params=params, headers=headers,
                                       timeout=httpx.Timeout(self._http.timeout.connect, read=read_s)) as response:
                    wait = _retry_after(response)
                    if response.status_code >= 400:
                        response.read()
                        if wait is None:
                            raise error_from_response(response)
                        problem = f"HTTP {response.status_code}: {error_from_response(response)}"
                    else:
                        for event, event_id, data, retry in _sse_events(response.iter_lines()):
                            if retry is not None:
                                retry_s = retry / 1000
                            if event in (kind, "end", ""):  # a row, the end, or a keep-alive comment
                                failures, failing_since = 0, time.monotonic()
                            if event_id is not None:
                                last_id = event_id
                            if event == "end":
                                return
                            if event == kind:
                                yield model.model_validate_json(data)
                        problem = "the stream closed before the job ended"
            except httpx.TransportError as error:
                problem = str(error) or type(error).__name__
            if time.monotonic() - failing_since > reconnect_s:
                raise ServiceUnavailable(f"event stream from {', '.join(self.urls)} broke and did not come "
                                         f"back within {reconnect_s:g} s: {problem}")
            self._next_replica()
            time.sleep(wait if wait is not None else min(retry_s * 2 ** failures, STREAM_BACKOFF_MAX_S))
            failures += 1


def _sse_events(lines: Iterator[str]) -> Iterator[tuple[str, str | None, str, int | None]]:
    """``(event, id, data, retry)`` per event of a ``text/event-stream`` (the WHATWG parsing
    rules: ``id`` persists until changed); a comment line gives ``("", None, "", None)``."""
    event, event_id, data, retry = "message", None, [], None
    for line in lines:
        if line == "":
            if data or retry is not None:
                yield event, event_id, "\n".join(data), retry
            event, data, retry = "message", [], None
            continue
        if line.startswith(":"):
            yield "", None, "", None
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
        elif name == "id" and "\0" not in value:
            event_id = value
        elif name == "retry" and value.isdigit():
            retry = int(value)
