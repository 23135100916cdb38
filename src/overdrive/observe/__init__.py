"""What a running job says about itself: step timers, heartbeats, the hang watchdog,
stragglers, preflight checks and the profiler.

One mechanism underneath: every rank keeps a cheap, always-on record of where it is (step,
phase) and where its time goes (`steps.StepRecorder`); a thread in the rank writes that
record to a small file at most once a second (`heartbeat.py`), and on each machine the
launcher side reads those files (`watchdog.py`: hangs, machines that left). The loop
(training/) and the launcher (launch/) call into this package; it never calls back.
"""

from overdrive.observe.run import RunObserver, for_run  # noqa: E402,F401 - the loop's entry points
