"""The one exception users see: a message that names the file, the problem and the fix."""


class UserError(Exception):
    """Bad input or configuration. The CLI prints the message (no traceback) and exits 2."""

    exit_code = 2
