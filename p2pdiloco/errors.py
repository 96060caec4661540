"""Errors a user (or a peer) caused: the CLI prints their one-line message and exits 2."""


class UserError(Exception):
    """Bad input, a missing resource or an impossible request; never a bug in p2pdiloco."""


class ConfigError(UserError, ValueError):
    """Inconsistent or out-of-range settings."""
