"""The error every configuration check raises."""


class ConfigError(ValueError):
    """A configuration that cannot run; the message is the one line shown to the user."""
