"""Building the package's CUDA kernels (``*.cu`` with ``hopper.cuh``) with nvcc at run time, once per machine.

Each variant is compiled into ``$PDL_TUNE_CACHE`` (default ``~/.cache/pdl-tune``) under a name that hashes the
sources and the compiler, so an edited kernel is rebuilt and every process (the tuner's workers included) shares
the build. The file is written under a temporary name and renamed, so a concurrent builder never loads a partial
library.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
HEADER = HERE / "hopper.cuh"

# Every kernel's LayerNorm row factors and softmax normaliser (hopper.cuh's ln_factors, softmax_rcp) by the MUFU's
# reciprocal and rsqrt; False builds the IEEE division and square root instead (an A/B switch: scripts/timeline.py's
# mufu=0). A kernel module's library cache keys on it.
MUFU_MATH = True

# The thread-block clusters' scheduling policy preference of every clustered launch (hopper.cuh's
# launch_z_clusters: cudaLaunchAttributeClusterSchedulingPolicyPreference; 0 default, 1 spread, 2 load balancing);
# None sets no attribute (the production build). An A/B switch: scripts/timeline.py's cluster_policy=N.
CLUSTER_POLICY: int | None = None

# The memory synchronization domain of every clustered launch (cudaLaunchAttributeMemSyncDomain: 0 default, 1 remote;
# the Triton kernels stay in the default domain); None sets no attribute (the production build). An A/B switch only
# (scripts/timeline.py's sync_domain=N): whether a kernel's end waits on its early-launched successor's traffic.
MEM_SYNC_DOMAIN: int | None = None
# The two switches' defines, tagged in a build's file name (one value under either define is another build).
# The language and warnings of every build (build; tests/test_verify.py compiles the same sources to PTX with them).
FLAGS = ("-std=c++17", "-diag-suppress=177")
AB_TAGS = {"HOPPER_CLUSTER_POLICY": "cp", "HOPPER_MEM_SYNC_DOMAIN": "sd"}


def build_key() -> tuple:
    """What every kernel module's library cache keys on besides its own defines: the module-wide switches above."""
    return (MUFU_MATH, CLUSTER_POLICY, MEM_SYNC_DOMAIN)


# The diagnostics define of every CUDA kernel (qkv_attn.cu's QA_DIAG, cluster_gemm.cu's CG_DIAG, mlp_cluster.cu's
# MLP_DIAG): bit 0 the trace's %globaltimer stamps, bit 1 those stamps in SM cycles (qkv_attn only), bit 2 the
# test-only racy variant, bit 3 the test-only held stores (cluster_gemm only: tune verify). Each value is a library of
# its own, so that the production build (0) carries none of their branches (perf notes 33-34).
DIAG_TRACE, DIAG_CYCLES, DIAG_RACY, DIAG_HELD = 1, 2, 4, 8


def diag(trace, racy: bool, cycles: bool = False, held: bool = False) -> int:
    """The diagnostics define of a launch: the trace's stamps where it has a trace buffer (in SM cycles with
    ``cycles``), the racy variant and the held stores where asked."""
    stamps = (DIAG_TRACE | (DIAG_CYCLES if cycles else 0)) if trace is not None else 0
    return stamps | (DIAG_RACY if racy else 0) | (DIAG_HELD if held else 0)


def nvcc() -> str | None:
    for cand in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("PDL_TUNE_CACHE", Path.home() / ".cache" / "pdl-tune"))


# PDL_TUNE_BUILD_LOG=FILE: each build a process asks for (cached or not) is appended to FILE as one JSON line, with
# the test that asked where pytest runs one: what tests/conftest.py turns into the list it prebuilds (prebuild).
BUILD_LOG_ENV = "PDL_TUNE_BUILD_LOG"


def build(source: Path, defines: dict[str, int], who: str) -> ctypes.CDLL:
    """The shared library of ``source`` built for sm_90a with ``-Dname=value`` for each define (cached)."""
    if not MUFU_MATH:
        defines = {**defines, "HOPPER_IEEE_MATH": 1}
    if CLUSTER_POLICY is not None:
        defines = {**defines, "HOPPER_CLUSTER_POLICY": CLUSTER_POLICY}
    if MEM_SYNC_DOMAIN is not None:
        defines = {**defines, "HOPPER_MEM_SYNC_DOMAIN": MEM_SYNC_DOMAIN}
    if os.environ.get(BUILD_LOG_ENV):
        _log_build(Path(os.environ[BUILD_LOG_ENV]), source, defines)
    return ctypes.CDLL(str(compile_library(source, defines, who)))


def library_path(source: Path, defines: dict[str, int], who: str) -> Path:
    """Where the cache keeps the shared library of ``source`` under exactly ``defines``: a name that hashes the
    sources, the compiler and its extra flags."""
    compiler = nvcc()
    if compiler is None:
        raise RuntimeError(f"{who}: nvcc not found (PATH or $CUDA_HOME/bin); this kernel needs the CUDA toolkit")
    tag = hashlib.sha256(source.read_bytes() + HEADER.read_bytes() + compiler.encode()
                         + " ".join(_extra_flags()).encode()).hexdigest()[:16]
    # (the A/B defines by name: two of them set to the same value must not share a file)
    variant = "-".join(AB_TAGS.get(k, "") + str(v) for k, v in defines.items())
    return cache_dir() / f"{source.stem}-{tag}-{variant}.so"


def _extra_flags() -> list[str]:
    # PDL_TUNE_NVCC_LINEINFO=1: source lines in the SASS, for a profiler's per-line view (a separate build)
    return ["-lineinfo"] if os.environ.get("PDL_TUNE_NVCC_LINEINFO") == "1" else []


def compile_library(source: Path, defines: dict[str, int], who: str) -> Path:
    """The cached shared library of ``source`` under exactly ``defines``, built by nvcc where it is not yet."""
    out = library_path(source, defines, who)
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so")
        os.close(fd)
        cmd = [nvcc(), "-O3", *FLAGS, "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC",
               *_extra_flags(), *(f"-D{k}={v}" for k, v in defines.items()), "-o", tmp, str(source)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            os.unlink(tmp)
            last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"{who}: nvcc failed: {last}")
        os.replace(tmp, out)
    return out


def _log_build(log: Path, source: Path, defines: dict[str, int]) -> None:
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[0]  # (its file: tests/test_x.py)
    line = json.dumps({"source": source.name, "defines": defines, "test": test}) + "\n"
    with open(log, "a") as fh:  # (one short write in append mode: processes that share the log do not interleave)
        fh.write(line)


def read_build_log(path: Path, tests: set[str] | None = None) -> list[dict]:
    """The distinct builds of a PDL_TUNE_BUILD_LOG file, in first-asked order; with ``tests``, only those that a test
    of one of those files asked for (``tests/test_x.py``). A line that does not parse is skipped."""
    seen, out = set(), []
    for line in Path(path).read_text().splitlines():
        try:
            b = json.loads(line)
            key = (b["source"], json.dumps(b["defines"], sort_keys=True))
        except (ValueError, KeyError, TypeError):
            continue
        if key in seen or (tests is not None and b.get("test") not in tests):
            continue
        seen.add(key)
        out.append({"source": b["source"], "defines": b["defines"]})
    return out


def prebuild(builds: list[dict], jobs: int) -> tuple[int, list[str]]:
    """Build the listed variants ({"source": a file name in this folder, "defines": {...}}, as PDL_TUNE_BUILD_LOG
    writes them) into the cache, up to ``jobs`` nvcc processes side by side; a variant already cached costs nothing.
    Returns how many were built now, and why others failed (an unknown source, nvcc's error): such a variant fails
    again where a test builds it, and says so there."""
    from concurrent.futures import ThreadPoolExecutor

    def one(b: dict) -> tuple[bool, str | None]:
        source = HERE / str(b.get("source"))
        if source.suffix != ".cu" or not source.is_file():
            return False, f"{b.get('source')}: no such kernel source in {HERE}"
        try:
            defines = {str(k): int(v) for k, v in b["defines"].items()}
            if library_path(source, defines, source.stem).exists():
                return False, None
            compile_library(source, defines, source.stem)
            return True, None
        except (RuntimeError, OSError, KeyError, TypeError, ValueError, AttributeError) as e:
            return False, f"{source.name}: {e}"

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        done = list(pool.map(one, builds))
    return sum(built for built, _ in done), [why for _, why in done if why]


def c_argtypes(source: str, function: str) -> list:
    """The ctypes types of an ``extern "C" int function(...)`` parameter list in ``source`` (int, float, char*;
    any other type a pointer): what a launcher's declared argtypes must equal (a mismatch fails only on the GPU)."""
    params = re.search(rf'extern "C" int {function}\((.*?)\)\s*\{{', source, re.S).group(1)
    kinds = {"int": ctypes.c_int, "float": ctypes.c_float, "char*": ctypes.c_char_p}
    return [kinds.get(" ".join(prm.split()[:-1]).replace("const ", "").replace(" *", "*"), ctypes.c_void_p)
            for prm in params.split(",")]
