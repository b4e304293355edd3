"""User-facing errors: one clear line, raised before any training starts."""


class FedbenchError(ValueError):
    """Bad input (unknown name, invalid value, missing data, incompatible options).

    ``run.py`` prints ``fedbench: error: <message>`` and exits with status 2, so the
    message must be a single, self-contained line that says what to change.
    """


class DataError(FedbenchError):
    """A data set is missing, corrupt or cannot be provided."""
