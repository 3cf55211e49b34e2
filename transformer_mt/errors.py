"""The one exception type the CLI turns into a message and exit status 2 (no traceback)."""


class UserError(Exception):
    """Bad input from the user (config, data, paths): the message says what, where, and what to
    do."""
