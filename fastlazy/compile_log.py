"""What torch logs while fastlazy's compile thread compiles.

A background compile is the tiered engine's decision, not a call the user
made, so the warnings inductor and dynamo log during one (for instance
"aten._transformer_encoder_layer_fwd.default is missing a c-shim
implementation, using proxy executor as fallback", which changes nothing
about the program) would reach the user's stderr from code that never asked
for a compiler.  The compile process's stderr is discarded for the same
reason.  Here, records below ERROR that torch's loggers emit on the compile
thread are kept from torch's handlers and held in `messages()` instead;
errors still print, and with TORCH_LOGS set (the user asking for torch's
logs) everything prints as torch would print it.

torch's loggers do not propagate to the root logger: each registered one
has its own handler (torch._logging), which is where the filter goes.  The
handlers are looked up again before each job, because torch._logging
replaces them when its settings change.
"""
from __future__ import annotations

import collections
import logging
import os
import threading

KEPT = 50           # messages held for messages()

_messages: collections.deque = collections.deque(maxlen=KEPT)
_lock = threading.Lock()
_thread_ident: int | None = None


class _CompileThreadFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or threading.get_ident() != _thread_ident:
            return True
        with _lock:
            _messages.append(f"{record.levelname} {record.name}: {record.getMessage()}")
        return False


_FILTER = _CompileThreadFilter()


def quiet_this_thread() -> None:
    """Keep torch's log records below ERROR that the calling thread emits
    off torch's handlers (held for messages()); called by the compile
    thread before each job."""
    global _thread_ident
    # (read at each job: a filter installed earlier must let all through)
    _thread_ident = None if os.environ.get("TORCH_LOGS") else threading.get_ident()
    if _thread_ident is None:
        return
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if (name == "torch" or name.startswith("torch.")) and isinstance(logger, logging.Logger):
            for handler in logger.handlers:
                if _FILTER not in handler.filters:
                    handler.addFilter(_FILTER)


def messages() -> list[str]:
    """The last KEPT messages torch logged below ERROR during background
    compiles, oldest first ("LEVEL logger: message")."""
    with _lock:
        return list(_messages)
