"""The one clock a test may read: a guard against a hang, never a claim about speed.

A test proves *which* path ended a wait from what the run says (the error naming its key, a
count, a message the timeout path cannot print), not from how long it took: a busy 2-core
machine may take many times longer than an idle one, and a test must pass on it
(docs/testing.md). What a guard catches is a wait that never ends, so it is minutes, not a
multiple of the expected time: a failing guard means a hang, whatever the machine.
"""

HANG_GUARD_S = 600.0
