"""What one request may ask of ``marlow serve`` (:mod:`marlow.serving.server`), apart from the
server so that the CLI reads the defaults without loading FastAPI or torch."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """The server's limits; ``marlow serve`` options of the same names.

    ``max_body_bytes``: the largest request body (a 413 past it); ``max_tokens``: the largest
    ``max_tokens`` a request may ask (a 400), besides the model's context; ``max_waiting``: the
    questions that may wait for the engine (a 503 past it); ``timeout_s``: how long a request
    may wait for its answer (a 503 then)."""

    max_body_bytes: int = 1 << 20
    max_tokens: int = 32_768
    max_waiting: int = 1024
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_tokens", "max_waiting", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
