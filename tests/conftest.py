"""Fixtures shared by unit and integration tests."""

import signal

# A test suite started from a non-interactive shell's background job (`cmd &`) inherits SIGINT ignored,
# and so would every `l4m run` / `l4m up` it starts: the Ctrl-C tests would then test nothing but the
# shell. An ignored disposition survives exec, a handler does not, so taking SIGINT back here gives the
# children the default one (and pytest its KeyboardInterrupt).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
