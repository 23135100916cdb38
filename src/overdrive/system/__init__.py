"""What this machine has and runs: hardware detection (hardware.py) and the `overdrive env` report (report.py)."""
