"""The command line: ``python -m nbkv demo`` and ``python -m nbkv info``.

``demo`` runs :func:`nbkv.demo.run_demo` (a synthetic prefill and decode loop, timed
against NumPy); ``info`` prints versions, supported dtypes and the state of CUDA. Bad input
is reported as ``error: ...`` with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys

__all__ = ["main"]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _info() -> int:
    import nbkv

    print(f"nbkv        {nbkv.__version__}")
    for dist in ("numpy", "numba", "numba-cuda"):
        print(f"{dist:<11} {_version(dist)}")
    print("dtypes      " + ", ".join(str(d) for d in nbkv.supported_dtypes()))
    simulator = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
    try:
        from numba import cuda

        available = "yes" if cuda.is_available() else "no"
    except Exception as err:  # a broken CUDA install must not break `info`
        available = f"unknown (importing numba.cuda failed: {type(err).__name__}: {err})"
    print(f"cuda        {available}")
    print(f"simulator   {'on' if simulator else 'off'} (NUMBA_ENABLE_CUDASIM)")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nbkv", description="nbkv: a KV cache for transformer decoding"
    )
    sub = parser.add_subparsers(dest="command", metavar="{demo,info}")
    demo = sub.add_parser("demo", help="prefill + decode into a KVCache, timed against NumPy")
    for flag, dest, default, what in (
        ("--layers", "num_layers", 8, "layers"),
        ("--kv-heads", "num_kv_heads", 8, "KV heads per layer"),
        ("--head-dim", "head_dim", 128, "head dimension"),
        ("--batch", "batch", 1, "batch size"),
        ("--prompt", "prompt_len", 512, "prompt positions (prefill)"),
        ("--new-tokens", "new_tokens", 256, "decode steps"),
        ("--seed", "seed", 0, "seed of the random K/V data"),
    ):
        demo.add_argument(flag, dest=dest, type=int, default=default, help=f"{what} ({default})")
    demo.add_argument("--dtype", default="float32", help="storage dtype (float32)")
    demo.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    demo.add_argument("--layout", choices=("bhsd", "bshd"), default="bhsd")
    sub.add_parser("info", help="versions, dtypes and CUDA availability")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "info":
        return _info()

    from .demo import run_demo
    from .errors import KVCacheError

    options = {k: v for k, v in vars(args).items() if k != "command"}
    try:
        run_demo(**options)
    except KVCacheError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
