"""The one error type of the format seam."""


class FormatError(ValueError):
    """The tensors stored under a prefix are missing, inconsistent or of an unsupported format."""
