"""The node's privacy ledger: what each private data set has spent, across runs, in one SQLite file.

Epsilon protects a data owner's data, not a run. The ledger lives on the node, in a file the
organisation controls (node config ``privacy-ledger``; default ``$FLWR_HOME/flwr-verl/
privacy-ledger.sqlite``, Flower's own state directory, ``~/.flwr`` unless ``FLWR_HOME`` is set),
and is the only source of truth for a client's spent epsilon: the server never sends one.

**Key.** A ``DataSetKey``: the SHA-256 of the data set's distinct prompts
(``fingerprint_prompts``; each prompt's messages by role and content, in any order, repeats
counted once) plus the privacy unit. The privacy unit is a prompt with everything attached to
it, so the key is the prompts alone: whatever run, federation or **stage** uses the same
prompts spends one budget. A prompt's policy row (verl's format, ground truth aside), its SFT
unit (its responses) and its preference unit (its pairs) key alike (``stages.unit_prompts``), so
SFT or a reward model on a client's private prompts and PPO on the same prompts compose in one
account, and disjoint prompt sets keep their own. A changed prompt set is a new entry, and so
is a *different subset* of the same prompts: an overlap that is not the whole set is not
pooled, so keep a data set's prompts fixed across runs and stages, or account the overlap
yourself (``privacy.compose``). Ledgers written before this key (a hash of the whole rows) keep
their entries, which ``show`` lists, but a new spend on the same data starts a new entry.

**Check and spend in one transaction.** ``spend`` opens ``BEGIN IMMEDIATE`` (SQLite's write
lock: a second spender waits, up to ``timeout``), reads the data set's history, refuses if the
planned spend would pass the budget, and otherwise appends it and commits. So two runs using
the same data at once cannot both spend the last of the budget. The client calls it *before*
training, so the spend is on disk before the update exists, let alone leaves the node: a crash
after training never under-counts, and a crash (or a failed fit) before sending over-counts by
that one round. Spends are append-only; nothing ever removes one.

**Client-level spends** (``spend_client_level``): a round of client-level DP
(``distributed_dp.py``) is recorded against the same data set's fingerprint with privacy unit
"client", in its own table: its mechanism (the Skellam noise's variance and sensitivities) is
not DP-SGD's, and its epsilon, at its own delta, protects a different unit, so the two are never
composed into one number. It is checked against its own budget (node config
``client-epsilon-budget``) in the same way, before training.

**Durability.** Rollback-journal mode (``journal_mode=DELETE``) with ``synchronous=FULL`` (and
``fullfsync`` on macOS): a commit returns only after the journal and the database file are
fsynced, so a committed spend survives a crash or power loss. WAL mode is not used: it needs
shared memory, which network file systems do not provide, and the ledger writes once per round.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from flwr_verl.config import FlwrVerlError
from flwr_verl.privacy.distributed_dp import PRIVACY_UNIT as CLIENT_UNIT
from flwr_verl.privacy.distributed_dp import ClientLevelAccount, SkellamPlan
from flwr_verl.privacy.dpsgd import IterationMechanism, PrivacyAccount

NODE_PRIVACY_LEDGER = "privacy-ledger"  # node-config key: path of this node's ledger file
IN_MEMORY = ":memory:"  # a ledger that dies with its process: for in-process experiments only

_SCHEMA = """
CREATE TABLE IF NOT EXISTS data_sets (
    fingerprint TEXT NOT NULL, unit TEXT NOT NULL, description TEXT NOT NULL, created REAL NOT NULL,
    PRIMARY KEY (fingerprint, unit));
CREATE TABLE IF NOT EXISTS spends (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    fingerprint TEXT NOT NULL, unit TEXT NOT NULL, run_id TEXT NOT NULL, server_round INTEGER NOT NULL,
    noise_multiplier REAL NOT NULL, sample_rate REAL NOT NULL, ppo_epochs INTEGER NOT NULL,
    iterations INTEGER NOT NULL, recorded REAL NOT NULL,
    metrics_noise_multiplier REAL NOT NULL DEFAULT 0,
    FOREIGN KEY (fingerprint, unit) REFERENCES data_sets (fingerprint, unit));
CREATE TABLE IF NOT EXISTS client_level_spends (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    fingerprint TEXT NOT NULL, unit TEXT NOT NULL, run_id TEXT NOT NULL, server_round INTEGER NOT NULL,
    variance REAL NOT NULL, l1_sensitivity REAL NOT NULL, l2_sensitivity REAL NOT NULL, sample_rate REAL NOT NULL,
    recorded REAL NOT NULL,
    FOREIGN KEY (fingerprint, unit) REFERENCES data_sets (fingerprint, unit));
"""
# Ledgers written before the metrics' mechanism was recorded get its column (0: no metric released).
_MIGRATION = "ALTER TABLE spends ADD COLUMN metrics_noise_multiplier REAL NOT NULL DEFAULT 0"


class LedgerError(FlwrVerlError, RuntimeError):
    """The privacy ledger cannot be opened, read or written: nothing is trained or sent."""


@dataclass(frozen=True)
class DataSetKey:
    """What one privacy budget belongs to: a data set's content hash and the privacy unit.
    ``description`` (where the data came from) is shown by ``flwr-verl ledger show``; it is not
    part of the key."""

    fingerprint: str
    unit: str
    description: str = ""


def fingerprint_prompts(prompts: Iterable[list[dict]]) -> str:
    """SHA-256 of a data set's distinct prompts, each a list of {'role', 'content'} messages (other
    message fields are ignored), independent of their order and of repeats."""
    digests = sorted({hashlib.sha256(json.dumps([[m["role"], m["content"]] for m in prompt]).encode()).digest()
                      for prompt in prompts})
    return hashlib.sha256(b"".join(digests)).hexdigest()


@dataclass(frozen=True)
class Spend:
    """The answer of ``PrivacyLedger.spend``: the data set's account before and after (equal when
    refused), and whether the spend was refused for the budget."""

    before: PrivacyAccount
    after: PrivacyAccount
    refused: bool


@dataclass(frozen=True)
class ClientLevelSpend:
    """The answer of ``PrivacyLedger.spend_client_level``: the data set's client-level epsilon
    (at the delta asked) before and after (equal when refused), and whether it was refused."""

    epsilon_before: float
    epsilon_after: float
    refused: bool


@dataclass(frozen=True)
class RunSpend:
    """One run's spends on one data set, for ``show``."""

    run_id: str
    first_round: int
    last_round: int
    iterations: int  # local iterations (privacy unit "prompt") or rounds (unit "client")
    account: PrivacyAccount | ClientLevelAccount


def default_path() -> Path:
    from flwr.supercore.utils import get_flwr_home

    return get_flwr_home() / "flwr-verl" / "privacy-ledger.sqlite"


class PrivacyLedger:
    """A node's privacy ledger in the SQLite file ``path`` (see the module docstring).

    Args:
        path: the ledger file. Its directory must exist, except for ``default_path()``'s, which
            is created: a configured path in a directory that is not there (a typo, an unmounted
            volume) would otherwise start an empty ledger, which under-counts. ``":memory:"``
            keeps the ledger in this process only (in-process experiments and tests).
        timeout: how long ``spend`` waits for another process's transaction on the same file.
        read_only: open an existing ledger to read it (``show``), never creating or changing it.
    """

    def __init__(self, path: str | Path, *, timeout: float = 30.0, read_only: bool = False) -> None:
        self.path = path if str(path) == IN_MEMORY else Path(path).expanduser()
        self.timeout = timeout
        self._lock = threading.Lock()  # one transaction at a time on this connection, whatever the thread
        if read_only:
            try:
                self._db = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, timeout=timeout)
                self._db.execute("SELECT count(*) FROM spends").fetchone()
            except sqlite3.Error as error:
                raise LedgerError(f"cannot read the privacy ledger {str(path)!r}: {error}") from error
            return
        if self.path != IN_MEMORY:
            if self.path == default_path():
                self.path.parent.mkdir(parents=True, exist_ok=True)
            if not self.path.parent.is_dir():
                raise LedgerError(f"node config {NODE_PRIVACY_LEDGER}={str(path)!r} is invalid: directory "
                                  f"{str(self.path.parent)!r} does not exist (create it, or fix the path)")
        try:
            self._db = sqlite3.connect(self.path, timeout=timeout, isolation_level=None, check_same_thread=False)
            for pragma in ("journal_mode=DELETE", "synchronous=FULL", "fullfsync=ON", "foreign_keys=ON"):
                self._db.execute(f"PRAGMA {pragma}")
            with self._transaction():
                for statement in _SCHEMA.split(";"):
                    self._db.execute(statement)
                columns = {row[1] for row in self._db.execute("PRAGMA table_info(spends)")}
                if "metrics_noise_multiplier" not in columns:
                    self._db.execute(_MIGRATION)
        except (sqlite3.Error, LedgerError) as error:
            raise LedgerError(f"node config {NODE_PRIVACY_LEDGER}={str(path)!r}: the privacy ledger must be a "
                              f"writable SQLite file: {error}") from error

    def close(self) -> None:
        self._db.close()

    # ------------------------------------------------------------------ writing
    def spend(self, key: DataSetKey, mechanism: IterationMechanism, iterations: int, *, budget: float,
              delta: float, accountant: str, run_id: str, server_round: int) -> Spend:
        """Record ``iterations`` iterations of ``mechanism`` on ``key``'s data set, unless the
        data set's total epsilon at ``delta`` would then pass ``budget`` (0: no budget); check and
        write are one transaction, committed (fsynced) before this returns."""
        with self._transaction():
            before = self._account(key, accountant)
            after = before.after(mechanism, iterations)
            if budget and after.epsilon(delta) > budget:
                return Spend(before, before, refused=True)
            self._append(key, "spends", {
                "run_id": str(run_id), "server_round": server_round, "noise_multiplier": mechanism.noise_multiplier,
                "sample_rate": mechanism.sample_rate, "ppo_epochs": mechanism.ppo_epochs, "iterations": iterations,
                "metrics_noise_multiplier": mechanism.metrics_noise_multiplier})
            return Spend(before, after, refused=False)

    def spend_client_level(self, key: DataSetKey, plan: SkellamPlan, *, budget: float, delta: float, run_id: str,
                           server_round: int) -> ClientLevelSpend:
        """Record one round of client-level DP under ``plan`` on ``key``'s data set (privacy unit
        "client"), at sampling rate 1 (see ``distributed_dp``'s "The node's own account"), unless
        its client-level epsilon at ``delta`` would then pass ``budget`` (0: no budget); one
        transaction, committed (fsynced) before this returns."""
        if key.unit != CLIENT_UNIT:
            raise LedgerError(f"client-level spends belong to privacy unit {CLIENT_UNIT!r}, not {key.unit!r}")
        with self._transaction():
            account = self._client_level_account(key)
            before = account.epsilon(delta)
            account.record(plan, sample_rate=1.0)
            after = account.epsilon(delta)
            if budget and after > budget:
                return ClientLevelSpend(before, before, refused=True)
            self._append(key, "client_level_spends", {
                "run_id": str(run_id), "server_round": server_round, "variance": plan.central_variance,
                "l1_sensitivity": plan.l1_sensitivity, "l2_sensitivity": plan.l2_sensitivity, "sample_rate": 1.0})
            return ClientLevelSpend(before, after, refused=False)

    def _append(self, key: DataSetKey, table: str, spend: dict[str, Any]) -> None:
        """Append one spend of ``key``'s data set to ``table`` (registering the data set on its
        first spend); inside the caller's transaction."""
        now = time.time()
        self._db.execute("INSERT OR IGNORE INTO data_sets VALUES (?, ?, ?, ?)",
                         (key.fingerprint, key.unit, key.description, now))
        columns = ["fingerprint", "unit", *spend, "recorded"]
        self._db.execute(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                         (key.fingerprint, key.unit, *spend.values(), now))

    @contextlib.contextmanager
    def _transaction(self):
        """A write transaction: SQLite's write lock, taken at once, so check and write are atomic."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as error:
                locked = "locked" in str(error)
                raise LedgerError(f"privacy ledger {self.path}: " + (
                    f"no write lock within {self.timeout:g} s (another run is holding it): {error}" if locked
                    else f"cannot write: {error}")) from error
            try:
                yield
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # ------------------------------------------------------------------ reading
    def _spends(self, where: str = "", args: tuple = ()) -> list[tuple]:
        return self._db.execute(
            "SELECT fingerprint, unit, run_id, server_round, noise_multiplier, sample_rate, ppo_epochs, iterations, "
            f"metrics_noise_multiplier FROM spends {where} ORDER BY id", args).fetchall()

    def _account(self, key: DataSetKey, accountant: str) -> PrivacyAccount:
        return _account_of(self._spends("WHERE fingerprint = ? AND unit = ?", (key.fingerprint, key.unit)),
                           accountant)

    def account(self, key: DataSetKey, accountant: str = "rdp") -> PrivacyAccount | ClientLevelAccount:
        """Everything ``key``'s data set has spent, over all runs (a ``ClientLevelAccount`` for
        privacy unit "client", whose epsilon ignores ``accountant``)."""
        if key.unit == CLIENT_UNIT:
            return self._client_level_account(key)
        return self._account(key, accountant)

    def _client_level_rows(self, key: DataSetKey) -> list[tuple]:
        return self._db.execute(
            "SELECT run_id, server_round, variance, l1_sensitivity, l2_sensitivity, sample_rate "
            "FROM client_level_spends WHERE fingerprint = ? AND unit = ? ORDER BY id",
            (key.fingerprint, key.unit)).fetchall()

    def _client_level_account(self, key: DataSetKey) -> ClientLevelAccount:
        return _client_level_account_of(self._client_level_rows(key))

    def data_sets(self) -> list[DataSetKey]:
        return [DataSetKey(*row) for row in
                self._db.execute("SELECT fingerprint, unit, description FROM data_sets ORDER BY created")]

    def runs(self, key: DataSetKey, accountant: str = "rdp") -> list[RunSpend]:
        """``key``'s spends grouped by run, in the order the runs first spent."""
        if key.unit == CLIENT_UNIT:
            by_round: dict[str, list[tuple]] = {}
            for row in self._client_level_rows(key):
                by_round.setdefault(row[0], []).append(row)
            return [RunSpend(run_id, min(r[1] for r in rows), max(r[1] for r in rows), len(rows),
                             _client_level_account_of(rows)) for run_id, rows in by_round.items()]
        by_run: dict[str, list[tuple]] = {}
        for row in self._spends("WHERE fingerprint = ? AND unit = ?", (key.fingerprint, key.unit)):
            by_run.setdefault(row[2], []).append(row)
        return [RunSpend(run_id, min(r[3] for r in rows), max(r[3] for r in rows), sum(r[7] for r in rows),
                         _account_of(rows, accountant)) for run_id, rows in by_run.items()]


def _account_of(rows: list[tuple], accountant: str) -> PrivacyAccount:
    account = PrivacyAccount(accountant)
    for *_, sigma, q, epochs, iterations, metrics_sigma in rows:
        account.record(IterationMechanism(sigma, q, epochs, metrics_sigma), iterations)
    return account


def _client_level_account_of(rows: list[tuple]) -> ClientLevelAccount:
    account = ClientLevelAccount()
    for *_, variance, l1, l2, q in rows:
        account.record_step(variance, l1, l2, q)
    return account


def show(ledger: PrivacyLedger, delta: float, accountant: str = "rdp", client_level_delta: float = 1e-5) -> str:
    """Each data set's spent epsilon: per run, and in total (composed, not summed); at ``delta``
    for privacy unit "prompt", at ``client_level_delta`` for unit "client"."""
    lines = [f"privacy ledger {ledger.path}: epsilon at delta={delta:g} ({accountant} accountant); "
             f"privacy unit client at delta={client_level_delta:g} (Skellam RDP)"]
    keys = ledger.data_sets()
    for key in keys:
        lines.append(f"data set {key.fingerprint[:16]} (privacy unit: {key.unit}): {key.description}")
        at, steps = (client_level_delta, "rounds") if key.unit == CLIENT_UNIT else (delta, "iterations")
        for run in ledger.runs(key, accountant):
            lines.append(f"  run {run.run_id}: rounds {run.first_round}-{run.last_round}, {run.iterations} "
                         f"{steps}, epsilon {_fmt(run.account.epsilon(at))}")
        total = ledger.account(key, accountant)
        count = total.rounds if key.unit == CLIENT_UNIT else total.steps
        lines.append(f"  total: {count} {steps}, epsilon {_fmt(total.epsilon(at))}")
    if not keys:
        lines.append("no spends recorded")
    return "\n".join(lines)


def _fmt(epsilon: float) -> str:
    return "inf" if math.isinf(epsilon) else f"{epsilon:.3f}"
