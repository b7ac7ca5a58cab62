"""One error hierarchy: every error orthon raises on purpose is an ``OrthonError``, so the CLI can
print its one-line message instead of a traceback. Each also keeps the builtin base callers expect."""
from __future__ import annotations


class OrthonError(Exception):
    """An error whose message names the input and what is wrong; the CLI prints it without a traceback."""


class ConfigError(OrthonError, ValueError):
    """A recipe key or value that does not fit its dataclass; the message names its dotted path."""


class DataError(OrthonError, ValueError):
    """Bad data input or a damaged store; the message names the file and what is wrong."""


class CheckpointError(OrthonError, ValueError):
    """A checkpoint or weights directory that is missing, incomplete, corrupted or holds another model."""


class EngineUnavailable(OrthonError, ConnectionError):
    """A generation engine did not answer (refused, timed out, died, answered garbage): callers retry
    the request on another engine; the message names the engine and what happened."""


class WrongBaseVersion(CheckpointError):
    """A weight delta made against another version than the one the engine holds: refused, nothing
    changed; the sender needs to send a full copy (or the delta of the right base)."""


class DivergedError(OrthonError, FloatingPointError):
    """Training gave non-finite gradients in more steps in a row than it may skip; the message names the
    steps and the limit."""
