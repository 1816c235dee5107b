"""One exception type for everything a user can fix, so the CLI prints one line and exits 2."""


class UserError(Exception):
    """A problem in the user's input or environment: printed as one line, no traceback, exit code 2."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))  # always one line


class SiteError(UserError):
    """A site file that does not validate, or a site name that matches no file."""


class AllocationError(UserError):
    """A job environment or a request that cannot be turned into an Allocation."""


class LayoutError(UserError):
    """An allocation that cannot be laid out as the site asks (e.g. per-gpu workers without GPUs)."""
