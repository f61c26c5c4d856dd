"""Command lines and helpers on top of the library: ``flwr-verl`` (``cli``: check a config, read a
node's ledger), what the command lines read (``config_files``: a TOML file and ``--set``
overrides), the centralized baseline (``baseline``), the privacy audit (``audit``), serving a
run's policy with the de-identification filter (``serving``) and the SmolLM2 model builder
(``smollm2``).
"""

from flwr_verl._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "FLAWS": "audit",
    "answer_log_probs": "audit",
    "broken_mechanism": "audit",
    "run_audit": "audit",
    "train_planted": "audit",
    "Record": "baseline",
    "format_record": "baseline",
    "pooled_rows": "baseline",
    "run_baseline": "baseline",
    "APP_DIR": "cli",
    "COMPLETED": "cli",
    "check_config": "cli",
    "checked_run_config": "cli",
    "flwr_command": "cli",
    "ledger_show": "cli",
    "run": "cli",
    "run_config_args": "cli",
    "run_status": "cli",
    "app_defaults": "config_files",
    "parse_overrides": "config_files",
    "read_run_config": "config_files",
    "deidentified_generation": "serving",
    "BuildError": "smollm2",
    "GGUF_FILE": "smollm2",
    "INSTALL_HINT": "smollm2",
    "PACKAGE": "smollm2",
    "SPECIAL_TOKENS": "smollm2",
    "build": "smollm2",
    "gguf_path": "smollm2",
    "require_gguf": "smollm2",
    "special_tokens": "smollm2",
})
