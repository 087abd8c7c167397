"""Ctrl-C while a run starts (the libraries loading, the flags checked, the ranks not yet running): one line
and exit code 130, not a KeyboardInterrupt traceback from wherever the import was. Stdlib only, so that a
recipe script can enter it before it imports anything heavy."""

import contextlib
import sys


@contextlib.contextmanager
def interruptible():
    try:
        yield
    except KeyboardInterrupt:
        print("interrupted while starting: nothing was run", file=sys.stderr)
        raise SystemExit(130) from None
