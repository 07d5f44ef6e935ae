"""engine/accel.py: the environment MLX gets before it starts (MKL preload, cuDNN attention off)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.engine import accel

linux_only = pytest.mark.skipif(sys.platform == "darwin", reason="no CUDA switch on macOS")


def _env(**overrides: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in (accel.CUDNN_SDPA, accel.SDPA_SOURCE, accel.CUDA_GRAPHS, accel.GRAPHS_SOURCE,
                        accel.MARK)}
    for k, v in overrides.items():
        if v is not None:
            env[k] = v
    return env


@linux_only
def test_cuda_switch_only_when_the_user_left_it_unset() -> None:
    env: dict[str, str] = {}
    assert accel.cuda_env(env) == {accel.CUDNN_SDPA: "0", accel.SDPA_SOURCE: "dflash",
                                   accel.CUDA_GRAPHS: "0", accel.GRAPHS_SOURCE: "dflash"}
    assert accel.use_cuda_env(env) and env[accel.CUDNN_SDPA] == env[accel.CUDA_GRAPHS] == "0"
    assert accel.setting(accel.CUDNN_SDPA, env) == {"value": "0", "set_by": "dflash"}
    assert accel.setting(accel.CUDA_GRAPHS, env) == {"value": "0", "set_by": "dflash"}
    assert not accel.use_cuda_env(env)  # already set: nothing more

    user = {accel.CUDNN_SDPA: "1"}  # the user chose one switch: dflash sets only the other
    assert accel.cuda_env(user) == {accel.CUDA_GRAPHS: "0", accel.GRAPHS_SOURCE: "dflash"}
    both = {accel.CUDNN_SDPA: "1", accel.CUDA_GRAPHS: "1"}
    assert not accel.use_cuda_env(both) and both == {accel.CUDNN_SDPA: "1", accel.CUDA_GRAPHS: "1"}
    assert accel.setting(accel.CUDNN_SDPA, both) == {"value": "1", "set_by": "user"}
    assert accel.setting(accel.CUDA_GRAPHS, both) == {"value": "1", "set_by": "user"}
    assert accel.setting(accel.CUDNN_SDPA, {}) == {"value": None, "set_by": None}


@linux_only
def test_describe_reports_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(accel.MARK, "mkl (x)")
    monkeypatch.setenv(accel.CUDNN_SDPA, "0")
    monkeypatch.setenv(accel.SDPA_SOURCE, "dflash")
    monkeypatch.delenv(accel.CUDA_GRAPHS, raising=False)
    assert accel.describe() == f"mkl (x); {accel.CUDNN_SDPA}=0 (set by dflash)"
    monkeypatch.setenv(accel.CUDA_GRAPHS, "0")
    monkeypatch.setenv(accel.GRAPHS_SOURCE, "dflash")
    assert accel.describe() == (f"mkl (x); {accel.CUDNN_SDPA}=0 (set by dflash); "
                                f"{accel.CUDA_GRAPHS}=0 (set by dflash)")
    monkeypatch.delenv(accel.CUDA_GRAPHS)
    monkeypatch.delenv(accel.SDPA_SOURCE)
    monkeypatch.setenv(accel.CUDNN_SDPA, "1")
    assert accel.describe().endswith(f"{accel.CUDNN_SDPA}=1 (set by user)")


def test_describe_names_a_cuda_gpu_instead_of_advising_mkl() -> None:
    """A GPU worker without MKL said "mkl not installed: pip install ..." (an H100's dflashd
    status, session 38): on a GPU the CPU's BLAS does not matter, so it names the GPU."""
    assert accel.linux_text(True, "NVIDIA H100 80GB HBM3") == "MLX-CUDA on NVIDIA H100 80GB HBM3"
    assert accel.linux_text(True, "") == "MLX-CUDA on a GPU"
    assert "pip install 'dflash[fastcpu]'" in accel.linux_text(False, "")
    assert "mkl" not in accel.linux_text(True, "x")


def _run(code: str, env: dict[str, str], cwd: Path, module: str | None = None) -> str:
    args = ["-m", module] if module else ["-c", code]
    out = subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@linux_only
def test_import_sets_it_before_mlx_is_imported(tmp_path: Path) -> None:
    # importing the package sets them and stays light (its API is imported on first use)
    code = ("import sys, os; import dflash.engine; light = 'mlx.core' not in sys.modules; "
            "from dflash.engine import load_pair; "
            "print(os.environ.get('MLX_CUDA_USE_CUDNN_SDPA'), os.environ.get('MLX_USE_CUDA_GRAPHS'),"
            " light and 'mlx.core' in sys.modules)")
    assert _run(code, _env(), tmp_path) == "0 0 True"
    assert _run(code, _env(MLX_CUDA_USE_CUDNN_SDPA="1", MLX_USE_CUDA_GRAPHS="1"), tmp_path) == "1 1 True"
    # the value is in place when mlx is first imported (engine/__init__ applies it first thing)
    code = ("import os, sys\n"
            "class Spy:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'mlx': print('at mlx import:', os.environ.get('MLX_CUDA_USE_CUDNN_SDPA'),"
            " os.environ.get('MLX_USE_CUDA_GRAPHS'))\n"
            "sys.meta_path.insert(0, Spy())\n"
            "import dflash.engine\n"
            "from dflash.engine import stream_dflash_generate\n")
    assert _run(code, _env(), tmp_path) == "at mlx import: 0 0"


@linux_only
@pytest.mark.parametrize("blas", ["auto", "none"])
def test_reexecuted_child_inherits_it(tmp_path: Path, blas: str) -> None:
    """maybe_reexec (the `dflash` commands, the worker): the child, MKL-preloaded or not, has it."""
    (tmp_path / "probe.py").write_text(
        "import os, sys\n"
        "from dflash.engine import accel\n"
        "accel.maybe_reexec(module='probe')\n"
        "print(os.environ.get('MLX_CUDA_USE_CUDNN_SDPA'), os.environ.get('DFLASH_CUDNN_SDPA_SET_BY'),"
        " os.environ.get('MLX_USE_CUDA_GRAPHS'),"
        " 'LD_PRELOAD' in os.environ and 'mkl' in os.environ['LD_PRELOAD'])\n"
    )
    env = _env(DFLASH_BLAS=blas)
    env.pop("LD_PRELOAD", None)
    value, source, graphs, preloaded = _run("", env, tmp_path, "probe").split()
    assert (value, source, graphs) == ("0", "dflash", "0")
    assert preloaded == str(blas == "auto" and accel.find_mkl() is not None)
    value, source, graphs, _ = _run("", dict(env, MLX_CUDA_USE_CUDNN_SDPA="1"), tmp_path, "probe").split()
    assert (value, source, graphs) == ("1", "None", "0")


def test_a_choice_without_re_exec_stays_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """`blas = none` (or no MKL) is reported by describe() but never exported: a daemon started
    later from this process (a test, a script) must make its own choice, MKL included."""
    monkeypatch.delenv(accel.MARK, raising=False)
    monkeypatch.setattr(accel, "_CHOSEN", None)
    accel.maybe_reexec(blas="none")  # nothing to do: returns without re-executing
    assert accel.MARK not in os.environ
    assert accel.describe().startswith("default BLAS (blas = none)")


def test_mkl_threads_over_every_core_except_on_amd(tmp_path: Path) -> None:
    """MKL's OpenMP layer paid on the 2-core Xeon VM (session 12) and cost on the AMD EPYC
    ones (session 35: a 16-token verify 177 -> 118 ms single-threaded): the user's
    MKL_THREADING_LAYER wins, then one thread on AMD, then OpenMP where libiomp5 is beside MKL."""
    with_omp, without = tmp_path / "omp", tmp_path / "plain"
    with_omp.mkdir()
    without.mkdir()
    (with_omp / "libiomp5.so").write_bytes(b"")
    assert accel.threading_layer(with_omp, {}, vendor="GenuineIntel") == "INTEL"
    assert accel.threading_layer(without, {}, vendor="GenuineIntel") == "SEQUENTIAL"
    assert accel.threading_layer(with_omp, {}, vendor="AuthenticAMD") == "SEQUENTIAL"
    assert accel.threading_layer(with_omp, {"MKL_THREADING_LAYER": "INTEL"}, vendor="AuthenticAMD") == "INTEL"
    assert accel.threading_layer(with_omp, {}, vendor="") == "INTEL"  # unknown vendor: as before
    vendor = accel.cpuinfo("vendor_id")  # this machine's ("" where /proc/cpuinfo has none)
    assert vendor == vendor.strip() and (vendor != "" or not Path("/proc/cpuinfo").exists()
                                         or "vendor_id" not in Path("/proc/cpuinfo").read_text())
