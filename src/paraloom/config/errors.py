"""The one exception type for mistakes a user can fix; the CLI turns it into one line, exit 2."""


class UserError(ValueError):
    """Bad input (config, CLI argument, file); the message says what to do instead."""


class WorkersFailed(RuntimeError):
    """A worker process ended with an error; `exitcode` is the first failing rank's."""

    def __init__(self, message: str, exitcode: int) -> None:
        super().__init__(message)
        self.exitcode = exitcode


class Interrupted(Exception):
    """SIGINT or SIGTERM stopped the command: the CLI prints the message and exits 128 + `signum`."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum
