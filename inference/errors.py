"""Errors the engine raises for bad input; each names the problem."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine cannot serve as given (bad sampling value, prompt too long, ...).

    `param` names the offending field, so API layers can report it.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelLoadError(RuntimeError):
    """The model could not be found or is of an architecture the engine does not implement."""


class RequestExpiredError(InvalidRequestError):
    """A request whose deadline passed before it could start."""
