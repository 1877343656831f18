"""One study on a real PostgreSQL server, as on several hosts: the same `tune decoder --storage postgresql://..
--study-name S` started twice at once. Together they run exactly the budget, no trial lost or run twice,
the first trials queued once; each writes its own run folder from the shared study.

The server is started here on 127.0.0.1 with scripts/ci_postgres.sh (or given as PDL_TUNE_POSTGRES_URL);
the test is skipped, visibly, only where PostgreSQL is not installed.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tuner import faults
from tuner.storage import OWNER_ATTR, open_storage
from tuner.study import trial_status

ROOT = Path(__file__).resolve().parent.parent
REPLAY = ROOT / "tests" / "data" / "replay-bert-base-h200"
SCRIPT = ROOT / "scripts" / "ci_postgres.sh"
URL_ENV = "PDL_TUNE_POSTGRES_URL"
BUDGET = 16


def postgres_installed() -> bool:
    return bool(glob.glob("/usr/lib/postgresql/*/bin/initdb") or shutil.which("initdb"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def postgres_url():
    if os.environ.get(URL_ENV):
        yield os.environ[URL_ENV]
        return
    if not postgres_installed():
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql; .ci/run does it through "
                    "scripts/ci_postgres.sh)")
    if importlib.util.find_spec("psycopg2") is None and importlib.util.find_spec("psycopg") is None:
        pytest.fail("no PostgreSQL driver: pip install -e '.[test]' (psycopg2-binary)")
    # Not under pytest's tmp_path: that is private to this user, and the server may run as `postgres`.
    folder = tempfile.mkdtemp(prefix="pdl-tune-postgres-")
    for _ in range(3):  # (another process may take the free port before the server binds it: then another port)
        started = subprocess.run(["bash", str(SCRIPT), "start", folder, str(free_port())], capture_output=True,
                                 text=True, timeout=300)
        if started.returncode == 0:
            break
        subprocess.run(["bash", str(SCRIPT), "stop", folder], capture_output=True, timeout=60)
    assert started.returncode == 0, started.stderr[-3000:]
    try:
        yield started.stdout.strip().splitlines()[-1]
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", folder], capture_output=True, timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


def start_host(url: str, study: str, out: Path) -> subprocess.Popen:
    """One 'host': `tune decoder` on the shared study; each trial takes 0.3 s, and neither host starts its first until
    both are there (tuner.faults' barrier), so that both take part."""
    barrier = {"dir": str(out.parent / "barrier"), "parties": 2}
    env = dict(os.environ, **{faults.ENV: json.dumps({"sleep_s": 0.3, "barrier": barrier})})
    cmd = [sys.executable, "-m", "tuner.cli", "decoder", "--replay", str(REPLAY), "--trials", str(BUDGET),
           "--storage", url, "--study-name", study, "--out", str(out), "--no-progress"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_hosts_share_one_study(postgres_url, tmp_path):
    study = f"two-hosts-{os.getpid()}"
    # host 1 gives a password (the test server trusts local connections and ignores it): a run folder is committed
    # with results/, so no manifest may hold it (the command line kept it until session 46)
    with_password = postgres_url.replace("://postgres@", "://postgres:s3cretPW@")
    hosts = [start_host(url, study, tmp_path / f"host{i}") for i, url in enumerate((postgres_url, with_password))]
    outputs = [h.communicate(timeout=240)[0] for h in hosts]
    for h, out in zip(hosts, outputs):
        assert h.returncode == 0, out[-3000:]

    trials = optuna.load_study(study_name=study, storage=open_storage(postgres_url)).get_trials(deepcopy=False)
    assert sorted(t.number for t in trials) == list(range(len(trials)))  # no number twice, none skipped
    assert not [t for t in trials if not t.state.is_finished()]  # nothing left running or queued
    evaluated = [t for t in trials if t.state != TrialState.PRUNED and trial_status(t) != "interrupted"]
    assert len(evaluated) == BUDGET
    assert all(t.user_attrs.get("surplus") for t in trials if t.state == TrialState.PRUNED)
    assert sum(bool(t.user_attrs.get("is_baseline")) for t in trials) == 1  # queued by the study's creator only
    assert len({t.user_attrs[OWNER_ATTR]["pid"] for t in evaluated}) == 2  # both hosts ran trials
    for i in range(2):
        [best] = (tmp_path / f"host{i}").rglob("best.json")
        assert json.loads(best.read_text())["config"]
    assert "s3cretPW" not in outputs[1]
    assert all(b"s3cretPW" not in p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    [man] = (tmp_path / "host1").rglob("manifest.json")
    assert "postgres:***@" in json.loads(man.read_text())["command"]
