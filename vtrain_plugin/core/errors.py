"""One exception family for everything a user can get wrong.

The CLI turns any :class:`VTrainError` into one line on stderr and exit code 2; messages name the
field and the rule (with the arithmetic) that failed.
"""


class VTrainError(Exception):
    """Base class of every user-facing error."""


class ConfigError(VTrainError, ValueError):
    """A plan, model spec, cluster spec or config file is invalid."""


class TraceError(VTrainError):
    """The model could not be traced."""


class ProfileError(VTrainError):
    """The profile database or a profiling run failed."""
