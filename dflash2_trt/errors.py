"""The one project exception type.

Every user-facing error (bad config, bad checkpoint, mismatched drafter/target, missing backend, bad
prompt) raises :class:`DFlash2Error`; the CLIs map it to a one-line message and exit code 1.
"""


class DFlash2Error(Exception):
    """A user error: the message says what is wrong and, where it can, how to fix it."""
