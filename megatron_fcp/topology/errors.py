"""The error every topology module raises for an invalid description."""

__all__ = ["TopologyError"]


class TopologyError(ValueError):
    """A topology description is invalid; the message names the offending field."""
