"""Errors that reach the user as one clear line, never as a traceback."""


class ExlcliError(Exception):
    """Base class: the message is shown to the user as it is."""


class ModelLoadError(ExlcliError):
    """A checkpoint could not be read or is not supported."""


class UnsupportedArchitectureError(ModelLoadError):
    pass


class UnsupportedTensorTypeError(ModelLoadError):
    pass


class RequestError(ExlcliError):
    """A request is invalid (bad parameters, prompt longer than the context, ...)."""
