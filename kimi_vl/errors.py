"""Exception types users can catch. Every user-facing failure raises a `KimiVLError` subclass
whose message says what was wrong and how to fix it."""


class KimiVLError(Exception):
    """Base class of every kimi-vl error."""


class ConfigError(KimiVLError, ValueError):
    """A configuration is inconsistent (e.g. invalid `layer_types`, top-k larger than the expert count)."""


class ShapeError(KimiVLError, ValueError):
    """Tensors passed to a kernel or layer have incompatible shapes; the message names them."""


class InvalidMediaError(KimiVLError, ValueError):
    """An image or video cannot be read, or media and placeholder tokens do not match."""


class CheckpointError(KimiVLError, OSError):
    """A checkpoint directory is missing, incomplete, or not of the expected kind."""


class TrainingDivergedError(KimiVLError, RuntimeError):
    """Training produced non-finite losses or gradients for too many steps in a row."""


class DataUnavailableError(KimiVLError, OSError):
    """Benchmark data could not be loaded from the hub or from the given local directory; the message says
    which files are expected where."""
