"""The command line: ``python -m nbkv demo``, ``serve-demo``, ``append-demo``, ``eval``, ``info``.

``demo`` runs :func:`nbkv.demo.run_model_demo` (greedy decoding with the built-in model,
with an nbkv cache and recomputing without one, timed and plotted); ``append-demo`` runs
:func:`nbkv.demo.run_append_demo` (a synthetic prefill and decode loop of appends, timed
against NumPy); ``serve-demo`` runs :func:`nbkv.serving_demo.run_serve_demo` (continuous
batching against one request at a time); ``eval`` scores a model's held-out bits per
byte through the cache (:mod:`nbkv.models.evaluate`), and ``eval --kv NAME ...`` compares
caches' next-byte distributions with the float32 cache's (:mod:`nbkv.eval`: KL
divergence, top-1 agreement, bits per byte); ``info`` prints versions, supported dtypes
and the state of CUDA. This module only parses arguments: the logic lives in
:mod:`nbkv.demo`, :mod:`nbkv.models.evaluate` and :mod:`nbkv.eval`. Bad input is
reported as ``error: ...`` with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys

from .eval import GRAMMAR as KV_GRAMMAR

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
    sub = parser.add_subparsers(dest="command", metavar="{demo,serve-demo,append-demo,eval,info}")

    demo = sub.add_parser(
        "demo",
        help="greedy decoding with the built-in model: nbkv cache vs recomputing, timed",
        description="Decode with nbkv.models.Llama.default(), once with an nbkv KVCache and "
        "once recomputing the whole sequence per token (forward_nocache); check that both "
        "give the same tokens, report latency, tokens/s and cache memory, and plot latency "
        "per token (needs matplotlib: pip install 'nbkv[demo]').",
    )
    demo.add_argument("--new-tokens", type=int, default=200, help="tokens to generate, >= 2 (200)")
    which = demo.add_mutually_exclusive_group()
    which.add_argument(
        "--prompt", default=None, help="prompt text, as UTF-8 bytes (default: a built-in line)"
    )
    which.add_argument(
        "--prompt-tokens", type=int, default=None, help="instead, N random prompt token ids"
    )
    demo.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cache device")
    demo.add_argument("--seed", type=int, default=0, help="seed of random prompt ids (0)")
    demo.add_argument(
        "--out", dest="out_dir", default="nbkv-demo", help="folder for the plot (nbkv-demo)"
    )
    demo.add_argument(
        "--threads",
        type=int,
        default=1,
        help="Numba and BLAS threads while decoding, for both methods (1; 0 leaves both as "
        "they are; BLAS is limited through threadpoolctl, if installed)",
    )

    serve = sub.add_parser(
        "serve-demo",
        help="continuous batching of many requests against one at a time, timed",
        description="Serve requests of held-out standard-library code with "
        "nbkv.serving.Engine (continuous batching over a paged cache, prefix caching) and "
        "with Llama.generate one request at a time; check the outputs are identical; "
        "print tokens/s, time to first token, peak KV bytes and the prefix-hit rate; plot "
        "the batch and the blocks in use over the steps (needs matplotlib).",
    )
    serve.add_argument("--requests", type=int, default=32, help="requests (32)")
    serve.add_argument(
        "--shared", type=int, default=256, help="tokens of the prefix every other one shares (256)"
    )
    serve.add_argument("--seed", type=int, default=0, help="seed of the workload (0)")
    serve.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cache device")
    serve.add_argument(
        "--out", dest="out_dir", default="nbkv-serve-demo", help="folder for the plot"
    )

    append = sub.add_parser(
        "append-demo", help="synthetic prefill + decode appends into a KVCache, vs NumPy"
    )
    for flag, dest, default, what in (
        ("--layers", "num_layers", 8, "layers"),
        ("--kv-heads", "num_kv_heads", 8, "KV heads per layer"),
        ("--head-dim", "head_dim", 128, "head dimension"),
        ("--batch", "batch", 1, "batch size"),
        ("--prompt", "prompt_len", 512, "prompt positions (prefill)"),
        ("--new-tokens", "new_tokens", 256, "decode steps"),
        ("--seed", "seed", 0, "seed of the random K/V data"),
    ):
        append.add_argument(flag, dest=dest, type=int, default=default, help=f"{what} ({default})")
    append.add_argument("--dtype", default="float32", help="storage dtype (float32)")
    append.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    append.add_argument("--layout", choices=("bhsd", "bshd"), default="bhsd")
    _add_eval(sub)
    sub.add_parser("info", help="versions, dtypes and CUDA availability")
    return parser


def _add_eval(sub) -> None:
    """The ``eval`` subcommand: bits per byte, or with ``--kv`` the KL table."""
    evaluate = sub.add_parser(
        "eval",
        help="held-out bits per byte of a model, through the cache",
        description="Score the held-out split of the standard library (the files "
        "nbkv.models.train never trains on) with a model, through an nbkv cache: each "
        "window of --context bytes prefilled in chunks, then decoded byte by byte. "
        "Prints the mean bits per byte; with --kv, a table of each cache's KL divergence "
        "from the float32 cache, top-1 agreement and bits per byte (--limit-bytes: the "
        "first that many held-out bytes).",
    )
    evaluate.add_argument(
        "--model", default=None, help="a checkpoint folder (default: the shipped model)"
    )
    evaluate.add_argument("--context", type=int, default=512, help="window, in bytes (512)")
    evaluate.add_argument("--prefill", type=int, default=256, help="prefill bytes a window (256)")
    evaluate.add_argument("--chunk", type=int, default=64, help="prefill chunk (64)")
    evaluate.add_argument(
        "--limit-bytes", type=int, default=None, help="stop after about this many bytes"
    )
    evaluate.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cache device")
    evaluate.add_argument(
        "--kv",
        nargs="+",
        metavar="NAME",
        default=None,
        help="instead, compare these caches' next-byte distributions with the float32 "
        "cache's (KL divergence, top-1 agreement, bits per byte; the fp16 noise floor is "
        "always a row). Names: " + KV_GRAMMAR.replace("%", "%%"),
    )


def _eval(args) -> int:
    from .models import Llama
    from .models.evaluate import held_out_bits_per_byte

    if args.kv is not None:
        from .eval import cache_factory

        for i, kv in enumerate(args.kv):  # a bad name fails before the model loads
            cache_factory(kv, argument=f"--kv {kv!r} (name {i + 1})")
    if args.model is None:
        model, name = Llama.default(device=args.device), "Llama.default() (shipped)"
    else:
        model, name = Llama.from_pretrained(args.model, device=args.device), args.model
    if args.kv is not None:
        return _eval_kv(args, model, name)
    r = held_out_bits_per_byte(
        model,
        limit_bytes=args.limit_bytes,
        context=args.context,
        prefill=args.prefill,
        chunk=args.chunk,
    )
    print(
        f"{name}: {r.bits_per_byte:.4f} bits per byte over {r.bytes:,} held-out bytes "
        f"({r.files} files, {r.windows} windows of {args.context}, prefill {args.prefill} "
        f"in chunks of {args.chunk}, then decode), {r.seconds:.1f} s"
    )
    return 0


def _eval_kv(args, model, name: str) -> int:
    import time

    from .eval import compare, format_table
    from .models.train import load_corpus

    t0 = time.perf_counter()
    files = load_corpus().held_out
    used, size = 0, 0  # the files the byte limit reaches into
    for f in files:
        if args.limit_bytes is not None and size >= args.limit_bytes:
            break
        used, size = used + 1, size + len(f)
    rows = compare(
        model,
        args.kv,
        files,
        limit_bytes=args.limit_bytes,
        context=args.context,
        prefill=args.prefill,
        chunk=args.chunk,
    )
    print(format_table(rows))
    print(
        f"\n{name}: {rows[0].bytes:,} held-out bytes ({used} files), windows of "
        f"{args.context}: prefill {args.prefill} in chunks of {args.chunk}, then decode. "
        f"KL(p_ref || p) in nats against the float32 cache; fp16 is the noise floor. "
        f"{time.perf_counter() - t0:.1f} s"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "info":
        return _info()

    from .demo import run_append_demo, run_model_demo
    from .errors import KVCacheError

    if args.command == "eval":
        try:
            return _eval(args)
        except KVCacheError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2

    if args.command == "serve-demo":
        from .serving_demo import run_serve_demo

        run = run_serve_demo
    else:
        run = run_model_demo if args.command == "demo" else run_append_demo
    options = {k: v for k, v in vars(args).items() if k != "command"}
    if args.command == "demo" and args.threads == 0:
        options["threads"] = None
    try:
        run(**options)
    except KVCacheError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
