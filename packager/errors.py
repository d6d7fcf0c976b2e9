"""The one exception type `pkg` shows to users: a message that says what was wrong and how to fix it."""


class UserError(Exception):
    """A problem with the user's input or environment; printed without a traceback.

    `exit_code` follows the CLI convention: 2 for invalid input (spec, arguments), 1 otherwise.
    """

    def __init__(self, message: str, *, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
