"""The error tree.  Each error knows its HTTP status and OpenAI `type`/`code`.

    SanctumError                       500 server_error
    ├── ClientError                    4xx: returned as is, never a fallback
    │   ├── BadRequest                 400 invalid_request_error
    │   ├── Unauthorized               401 invalid_request_error / invalid_api_key
    │   ├── Forbidden                  403 permission_error / route_not_allowed
    │   ├── NotFound                   404 invalid_request_error / model_not_found
    │   ├── PayloadTooLarge            413 invalid_request_error / payload_too_large
    │   ├── PromptTooLong              413 invalid_request_error / context_length_exceeded
    │   └── RateLimited                429 rate_limit_error / rate_limited (Retry-After)
    └── ServiceError                   5xx: every allowed rung failed
        ├── NoPrivateSeat              503 no_private_seat
        ├── AllRungsFailed             503 all_rungs_failed
        ├── Overloaded                 503 overloaded (Retry-After)
        └── Loading                    503 loading (Retry-After): the route's seats load

Seat outcomes map onto it: `Rejected(status, code)` becomes a ClientError with
that status and code; `Failed` on the last rung becomes a ServiceError.
"""

from __future__ import annotations

from typing import Any

# The code of a rejection that a larger rung may still take: a hosted upstream whose
# real context is smaller than configured says so (proxyd/hosted.py normalises the
# many spellings to it), and the ladder moves on (proxyd/ladder.py).
CONTEXT_LENGTH = "context_length_exceeded"


class SanctumError(Exception):
    status = 500
    type = "server_error"
    code = "internal_error"
    retry_after_s: int | None = None  # set: the response says Retry-After
    # False: the response says `x-should-retry: false`, which the openai and anthropic
    # SDKs obey (they retry every 5xx otherwise) for an error no retry would change
    should_retry: bool | None = None

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None,
                 param: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.param = param
        self.extra = extra

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {
            "message": self.message,
            "type": self.type,
            "code": self.code,
            "param": self.param,
        }
        error.update(self.extra)
        return {"error": error}


class ClientError(SanctumError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class BadRequest(ClientError):
    pass


class Unauthorized(ClientError):
    status = 401
    code = "invalid_api_key"


class Forbidden(ClientError):
    status = 403
    type = "permission_error"
    code = "route_not_allowed"


class NotFound(ClientError):
    status = 404
    code = "model_not_found"


class PayloadTooLarge(ClientError):
    status = 413
    code = "payload_too_large"


class PromptTooLong(ClientError):
    """Over the cap: OpenAI clients read `context_length_exceeded` as "trim the history
    and retry"; the 413 and its numbers say by how much."""

    status = 413
    code = "context_length_exceeded"


class RateLimited(ClientError):
    """The key is over its request rate; `retry_after_s` says when a request fits."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limited"

    def __init__(self, message: str, *, retry_after_s: int = 1, **extra: Any) -> None:
        super().__init__(message, **extra)
        self.retry_after_s = retry_after_s


class ServiceError(SanctumError):
    status = 503
    type = "server_error"
    code = "service_unavailable"


class NoPrivateSeat(ServiceError):
    code = "no_private_seat"


class AllRungsFailed(ServiceError):
    code = "all_rungs_failed"


class Overloaded(ServiceError):
    """Every rung was busy (its queue full): worth retrying soon, said by Retry-After."""

    code = "overloaded"
    retry_after_s = 1


class Loading(ServiceError):
    """No rung of the route is ready yet, and some are loading: nothing failed."""

    code = "loading"

    def __init__(self, message: str, *, retry_after_s: int = 5, **extra: Any) -> None:
        super().__init__(message, **extra)
        self.retry_after_s = retry_after_s


class NoRoom(ServiceError):
    """An on-demand seat cannot load: the memory budget (or max_loaded) is held by
    seats that are busy or always loaded.  Nothing failed; retry shortly."""

    code = "no_room"

    def __init__(self, message: str, *, retry_after_s: int = 5, **extra: Any) -> None:
        super().__init__(message, **extra)
        self.retry_after_s = retry_after_s


# A seat's own refusal of a prompt over its cap (`Rejected(413, SEAT_OVER_CAP)`), which
# clients are told as CONTEXT_LENGTH, as the proxy's own over-cap refusal is.
SEAT_OVER_CAP = "prompt_too_long"


def client_error(status: int, code: str, message: str, **extra: Any) -> ClientError:
    """The ClientError for a seat's `Rejected(status, code)`."""
    if code == SEAT_OVER_CAP:
        code = CONTEXT_LENGTH
    return ClientError(message, code=code, status=status, **extra)
