"""Ctrl-C while a run starts (the libraries loading, the flags checked, the ranks not yet running): one line
and exit code 130, not a KeyboardInterrupt traceback from wherever the import was. Stdlib only, so that a
recipe script can enter it before it imports anything heavy."""

import contextlib
import functools
import os
import signal
import sys

NOTHING_RUN = "interrupted while starting: nothing was run"


def stop_at_once(sig, _frame=None, *, say: str | None = None) -> None:
    """A signal handler for the start-up, before there is anything to save: the process ends now, with exit code
    128 + sig and the line ``say`` (a KeyboardInterrupt traceback from wherever it was, or death by the signal,
    which the launcher reports as a failure, is neither)."""
    if say:
        print(say, file=sys.stderr)
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(128 + sig)


@contextlib.contextmanager
def loading():
    """Around the imports of a process that has started nothing yet: SIGINT and SIGTERM end it at once. A
    KeyboardInterrupt raised inside an extension module's import can be swallowed by the C code importing it
    (torch's import of numpy): the run then went on as if never interrupted, or failed later on a half-imported
    numpy ("CPU dispatcher tracer already initialized"). A signal this process was started with ignored stays
    ignored (a rank, which imports the recipe's script as the launcher's main module, takes signals only once
    it can act on them: ``runtime.launch``)."""
    stop = functools.partial(stop_at_once, say=NOTHING_RUN)
    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)
           if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def interruptible():
    """Around a start-up that makes things to clean up (the dock's servers, --out's lock): Ctrl-C raises there,
    and ends the process with the same one line once they are cleaned up."""
    try:
        yield
    except KeyboardInterrupt:
        print(NOTHING_RUN, file=sys.stderr)
        raise SystemExit(130) from None
