"""MLX's CUDA graph-cache thrashing check: off unless the user set it (mlxb.doctor.graph_check_env)."""

import subprocess
import sys

from mlxb.doctor import GRAPH_CHECK_ENV, graph_check_env


def test_check_turned_off_when_unset():
    env = {"PATH": "/bin"}
    assert graph_check_env(env) == f"{GRAPH_CHECK_ENV}=0"
    assert env[GRAPH_CHECK_ENV] == "0" and env["PATH"] == "/bin"


def test_users_value_kept():
    env = {GRAPH_CHECK_ENV: "1"}
    assert graph_check_env(env) == f"{GRAPH_CHECK_ENV}=1 (from the environment)"
    assert env[GRAPH_CHECK_ENV] == "1"


def test_mlxbs_own_value_not_reported_as_the_users():
    # the CLI sets it, then its re-exec (or build_gateway in the same process) asks again
    env = {}
    graph_check_env(env)
    assert graph_check_env(dict(env)) == f"{GRAPH_CHECK_ENV}=0"


def test_cli_sets_it_before_any_command():
    code = ("import os, sys; from mlxb.commands import main as m; sys.argv = ['mlxb', '--help']\n"
            "try:\n    m.main()\nexcept SystemExit:\n    pass\n"
            f"print('VALUE', os.environ.get({GRAPH_CHECK_ENV!r}))")
    env = {"PATH": "/usr/bin:/bin", "MLXB_BLAS_PRELOAD": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "VALUE 0" in out.stdout, out.stdout + out.stderr
