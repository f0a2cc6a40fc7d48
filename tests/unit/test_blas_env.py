"""The CLI's re-exec environment: OpenBLAS preloaded and its idle workers' spin shortened (mlxb.doctor)."""

import json
import os
import subprocess
import sys

import pytest

from mlxb.doctor import BLAS_THREAD_TIMEOUT, blas_preload_path, reexec_env

LIB = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"


def test_reexec_preloads_openblas_and_sets_its_thread_timeout():
    env = reexec_env({"PATH": "/bin"}, LIB)
    assert env["LD_PRELOAD"] == LIB
    assert env["OPENBLAS_THREAD_TIMEOUT"] == BLAS_THREAD_TIMEOUT
    assert env["_MLXB_REEXEC"] == "1" and env["PATH"] == "/bin"


def test_reexec_keeps_the_users_preloads_and_timeout():
    env = reexec_env({"LD_PRELOAD": "/opt/libx.so", "OPENBLAS_THREAD_TIMEOUT": "20"}, LIB)
    assert env["LD_PRELOAD"] == f"{LIB}:/opt/libx.so"
    assert env["OPENBLAS_THREAD_TIMEOUT"] == "20"


def test_reexec_only_when_something_changes():
    assert reexec_env({}, None) is None  # no OpenBLAS (or MLXB_BLAS_PRELOAD=0)
    assert reexec_env({"_MLXB_REEXEC": "1"}, LIB) is None  # already the re-exec: never loops
    assert reexec_env({"LD_PRELOAD": LIB, "OPENBLAS_THREAD_TIMEOUT": "28"}, LIB) is None
    # preloaded by hand but with OpenBLAS's long spin: re-exec to add the timeout, without a second preload
    env = reexec_env({"LD_PRELOAD": LIB}, LIB)
    assert env["LD_PRELOAD"] == LIB and env["OPENBLAS_THREAD_TIMEOUT"] == BLAS_THREAD_TIMEOUT


@pytest.mark.skipif(blas_preload_path() is None, reason="no OpenBLAS installed here (the CLI keeps netlib)")
def test_cli_runs_with_the_timeout_it_sets():
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", "_MLXB_REEXEC", "LD_PRELOAD")}
    out = subprocess.run([sys.executable, "-m", "mlxb.commands.main", "doctor", "--json", "--quick"], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    facts = json.loads(out[out.index("{"):])
    assert facts["blas"] == "openblas"
    assert facts["openblas_thread_timeout"] == BLAS_THREAD_TIMEOUT


def test_doctor_advises_the_timeout_only_where_openblas_runs_without_one():
    from mlxb.doctor import blas_advice

    [tip] = blas_advice("openblas", {}, LIB)
    assert f"OPENBLAS_THREAD_TIMEOUT={BLAS_THREAD_TIMEOUT}" in tip
    assert blas_advice("openblas", {"OPENBLAS_THREAD_TIMEOUT": "28"}, LIB) == []  # the user's choice stands
    assert blas_advice("accelerate", {}, None) == []
    [tip] = blas_advice("netlib", {}, LIB)
    assert "LD_PRELOAD=" + LIB in tip
    [tip] = blas_advice("netlib", {"MLXB_BLAS_PRELOAD": "0"}, LIB)
    assert "MLXB_BLAS_PRELOAD=0" in tip
    [tip] = blas_advice("netlib", {}, None)
    assert "apt-get install libopenblas0-pthread" in tip
