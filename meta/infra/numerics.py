"""Reproducible CPU numerics in one place: which kernels run, and a record of what computed a result.

The CPU libraries under torch pick kernels by instruction set, so two x86-64 machines can give other last bits and
another θ*.  The pins (:data:`PINS`: a code path every AVX2 machine runs; table and sources in docs/numerics.md) are
read when a library starts, so :func:`pin_process` sets them before ``import torch``; :func:`pinned_env` builds such
an environment for child processes.  ``GRAM_NUMERICS=fast`` turns them off.

:func:`numerics_record` is what every results file stores: CPU model and kernel-selecting flags, the pins in effect,
thread counts, package builds, and on a GPU the card, driver, CUDA/cuDNN builds and the deterministic settings.
``python -m meta.infra.numerics probe`` prints digests of a few ops on fixed inputs; ``python -m meta.fingerprint``
is the golden run (:mod:`meta.fingerprint.golden`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from contextlib import contextmanager
from typing import Iterator, Mapping, MutableMapping, Optional, Sequence

PINS: dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OPENBLAS_CORETYPE": "Haswell",
    "NUMBA_CPU_NAME": "generic",
    "TORCH_DEVICE_BACKEND_AUTOLOAD": "1",
}
SWITCH = "GRAM_NUMERICS"  # "pinned" (default) | "fast"
MODES = ("pinned", "fast")
# CPU flags that change which kernels the libraries above choose
KERNEL_FLAGS = tuple(
    "sse4_2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16 avx512_vnni avx512_fp16 amx_bf16 amx_tile amx_int8 "
    "avx_vnni".split()
)


class NumericsError(RuntimeError):
    """The process cannot be pinned as asked (the one-line message says why and what to do)."""


def mode(env: Optional[Mapping[str, str]] = None) -> str:
    """``pinned`` or ``fast`` from ``GRAM_NUMERICS`` (one-line :class:`NumericsError` for anything else)."""
    value = (os.environ if env is None else env).get(SWITCH, "pinned").strip().lower() or "pinned"
    if value not in MODES:
        raise NumericsError(f"{SWITCH}={value!r}: expected one of {', '.join(MODES)}")
    return value


def pinned_env(env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """A copy of ``env`` (default ``os.environ``) with the pins set, unless ``GRAM_NUMERICS=fast``.

    The pins replace whatever the caller had for those variables: a run is pinned or it is not.
    """
    out = dict(os.environ if env is None else env)
    if mode(out) == "pinned":
        out.update(PINS)
    return out


STARTED_LIBRARIES = ("torch", "numpy", "numba")  # read the pinned variables when they start


def pinned(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``env`` (default ``os.environ``) holds every pin."""
    env = os.environ if env is None else env
    return all(env.get(k) == v for k, v in PINS.items())


def pin_process(environ: Optional[MutableMapping[str, str]] = None, reexec: bool = True) -> str:
    """Pin this process's numerics (unless ``GRAM_NUMERICS=fast``); returns the mode.

    Call it first in an entry point: before torch, numpy or numba is imported it sets ``os.environ``; after, it starts
    the same command line again with the pins set (``os.execve``, once; ``reexec=False`` raises :class:`NumericsError`
    instead).  ``environ``: a mapping to pin instead of ``os.environ`` (tests).
    """
    target = os.environ if environ is None else environ
    current = mode(target)
    if current == "fast" or pinned(target):
        return current
    started = [name for name in STARTED_LIBRARIES if name in sys.modules]
    if environ is not None or not started:
        target.update(PINS)
        return current
    if not reexec:
        raise NumericsError(
            f"{', '.join(started)} started before the numerics pins were set; set them in the environment first "
            "(meta.infra.numerics.pinned_env) or run with GRAM_NUMERICS=fast"
        )
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], pinned_env())
    return current  # not reached


def autoload_products() -> None:
    """torch's start-up hook (``setup.py``'s ``torch.backends`` entry point): install the pinned matrix products
    (:mod:`meta.infra.products`) when this process is pinned.  Never raises: torch would not start."""
    from meta.infra import products

    try:
        if mode() != "fast" and pinned():
            products.install()
    except Exception as err:  # the record names it; meta.fingerprint --check then fails on the digests
        products.failed(f"{type(err).__name__}: {err}")


@contextmanager
def torch_threads_kept() -> Iterator[int]:
    """Run the block (numba code: UMAP, pynndescent) and give torch back its intra-op thread count; yields it.

    Starting numba's OpenMP pool raises the calling thread's OpenMP thread count, which torch's intra-op pool shares
    (to the machine's core count: 2 on a 2-core VM, also under ``NUMBA_NUM_THREADS=3``). Without this, every torch
    op a process runs after CHC's UMAP (a study's next world: its CLIP pretraining) would use that many threads, and
    a reduction split over other threads gives other last bits: a cell's numbers would depend on the machine's core
    count and on what ran before it in its process."""
    import torch

    threads = torch.get_num_threads()
    try:
        yield threads
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _cpu_model_and_flags() -> tuple[str, list[str]]:
    model, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model in ("", platform.machine(), platform.processor()):
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = value.split()
                if model and flags and key == "":
                    break
    except OSError:
        pass
    return model, flags


def numerics_record(device: Optional[str] = None) -> dict:
    """What computed a result: CPU, kernel-selecting flags, pins in effect, threads, builds, GPU settings.

    ``device``: the torch device the run used (``cuda...`` adds the card, driver and CUDA/cuDNN builds and the
    deterministic settings).  JSON-ready.
    """
    import torch

    from meta.infra.products import state as products_state

    model, flags = _cpu_model_and_flags()
    record = {
        "mode": mode(),
        "pins": {k: os.environ.get(k) for k in PINS},
        "pinned": pinned(),
        "cpu_model": model,
        "cpu_kernel_flags": [f for f in KERNEL_FLAGS if f in flags],
        "cpu_flags_sha256": hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:16],
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mkl": torch.backends.mkl.is_available(),
        "mkldnn": torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled,
        "matrix_products": products_state(),
        "packages": package_versions(),
    }
    if device is not None and str(device).startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        record["gpu"] = {
            "name": torch.cuda.get_device_name(index),
            "capability": list(torch.cuda.get_device_capability(index)),
            "driver": _nvidia_driver(),
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        }
    return record


# the packages whose builds a results file records (numerics_record)
PACKAGES = tuple(
    "torch numpy open_clip_torch learn2learn scikit-learn umap-learn hdbscan numba sentence-transformers".split()
)


def package_versions(names: Sequence[str] = PACKAGES) -> dict[str, Optional[str]]:
    """``{package: installed version or None}`` of ``names``, in their order."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, Optional[str]] = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _nvidia_driver() -> Optional[str]:
    from meta.infra import nvidia_smi

    rows = nvidia_smi.query("--query-gpu=driver_version")
    return rows[0][0] if rows else None


def probe() -> dict[str, str]:
    """SHA-256 (16 hex) of a few ops' fp32 outputs on fixed inputs, forward and backward: a knob's effect."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(96, 200, generator=gen)
    b = torch.randn(200, 72, generator=gen)
    img = torch.randn(2, 3, 32, 32, generator=gen)
    weight = torch.randn(16, 3, 8, 8, generator=gen)
    q, k, v = (torch.randn(2, 4, 17, 16, generator=gen) for _ in range(3))

    def digest(t: torch.Tensor) -> str:
        return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:16]

    x = a.clone().requires_grad_(True)
    y = F.layer_norm(F.gelu(x @ b), (72,)).softmax(-1)
    y.pow(2).sum().backward()
    return {
        "matmul": digest(a @ b),
        "softmax": digest(a.softmax(-1)),
        "gelu": digest(F.gelu(a)),
        "layer_norm": digest(F.layer_norm(a, (200,))),
        "exp_log": digest(a.exp().log1p()),
        "sum": digest(a.sum(0)),
        "conv2d": digest(F.conv2d(img, weight, stride=8)),
        "attention": digest(F.scaled_dot_product_attention(q, k, v)),
        "chain_backward": digest(x.grad),
    }


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: python -m meta.infra.numerics {probe,record} (the golden fingerprint: python -m meta.fingerprint)"
    if not argv or argv[0] not in ("probe", "record"):
        print(usage, file=sys.stderr)
        return 2
    try:
        pin_process()
    except NumericsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)
    out = probe() if argv[0] == "probe" else numerics_record()
    print(json.dumps(out, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
