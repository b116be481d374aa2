"""The one exception type for mistakes a user can fix; the CLI turns it into one line, exit 2."""


class UserError(ValueError):
    """Bad input (config, CLI argument, file); the message says what to do instead."""
