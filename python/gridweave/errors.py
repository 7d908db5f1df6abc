"""Typed errors of gridweave; the native engine raises these too."""


class GridError(ValueError):
    """Bad configuration or argument: raised on every rank before any communication."""


class CommError(RuntimeError):
    """A communication failed: a peer died, closed its connection or the transport broke."""


class CommTimeout(CommError, TimeoutError):
    """A blocking wait passed its timeout; the message names the op, the axis and the peers."""


class Diverged(RuntimeError):
    """Training diverged: the loss or gradient norm stayed non-finite, or a checkpoint would
    have held a non-finite tensor (it is never written)."""
