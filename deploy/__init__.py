"""Local deployment helpers: `python deploy/launch.py up|down`, `python deploy/certs.py`."""
