"""Launch helpers: `python deploy/launch.py up|down` (a local deployment), `deploy.simulation`
(an isolated `flwr run` simulation), `python deploy/certs.py` (throwaway TLS files and node keys)."""
