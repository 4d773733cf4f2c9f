"""Train the default model: ``python -m nbkv.models.train`` (needs torch: ``nbkv[train]``).

A byte-level Llama of :data:`nbkv.models.DEFAULT_CONFIG`'s shape learns Python from the
``.py`` files of the running interpreter's standard library: nothing is downloaded. The
corpus leaves out ``test``/``tests`` folders, ``idlelib``, ``site-packages`` and
``dist-packages``; about 2% of the files, chosen by a stable hash of their relative path
(:func:`is_held_out`), are never trained on and measure the model. Files are joined as
``STX file ETX`` (bytes 2 and 3, the config's bos and eos ids).

The model is written in plain torch with Hugging Face's weight names, so that
:class:`nbkv.models.Llama` loads what it learns as it loads any Llama checkpoint. The
run is reproducible from ``--seed`` (same corpus, same torch build, same thread count).
It writes, into ``--out``:

- ``model.safetensors``: the weights in float16, through nbkv's own safetensors writer;
- ``config.json``: the architecture, in Hugging Face's ``LlamaConfig`` form;
- ``training.json``: corpus files and bytes, Python and torch versions, steps, tokens seen,
  final train and held-out bits per byte, wall time, every option.

>>> from nbkv.models.train import is_held_out
>>> is_held_out("json/decoder.py"), is_held_out("asyncio/tasks.py")
(False, False)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import sysconfig
import time
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .config import DEFAULT_CONFIG, LlamaConfig

__all__ = [
    "Options",
    "corpus_files",
    "is_held_out",
    "load_corpus",
    "bits_per_byte_windows",
    "train",
    "main",
]

STX, ETX = 2, 3  # the config's bos and eos: a file is STX + its bytes + ETX
HELD_OUT_PERCENT = 2
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}


def is_held_out(relpath: str) -> bool:
    """Whether a corpus file (its path relative to the stdlib folder, '/'-separated) is
    in the held-out split: a stable hash, the same on every machine and run."""
    return zlib.crc32(relpath.encode()) % 100 < HELD_OUT_PERCENT


def corpus_files(root: str | None = None) -> list[str]:
    """The corpus: relative paths of the standard library's ``.py`` files, sorted."""
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        rel = os.path.relpath(folder, root)
        for name in sorted(files):
            if name.endswith(".py"):
                path = name if rel == "." else f"{rel}/{name}"
                out.append(path.replace(os.sep, "/"))
    return sorted(out)


@dataclass(frozen=True)
class Corpus:
    root: str
    train: np.ndarray  # uint8 token ids: the training files joined, STX file ETX
    held_out: list[np.ndarray]  # one array per held-out file, STX file ETX
    train_files: int
    held_out_files: int
    held_out_names: tuple[str, ...] = ()  # their paths, relative to root


def _tokens(data: bytes) -> np.ndarray:
    return np.frombuffer(bytes([STX]) + data + bytes([ETX]), np.uint8)


def load_corpus(root: str | None = None) -> Corpus:
    """Read every corpus file and split it (by :func:`is_held_out`)."""
    root = root or sysconfig.get_paths()["stdlib"]
    train, held, names = [], [], []
    for rel in corpus_files(root):
        with open(os.path.join(root, rel), "rb") as f:
            tokens = _tokens(f.read())
        if is_held_out(rel):
            held.append(tokens)
            names.append(rel)
        else:
            train.append(tokens)
    return Corpus(root, np.concatenate(train), held, len(train), len(held), tuple(names))


def held_out_windows(files: list[np.ndarray], context: int) -> Iterator[np.ndarray]:
    """Each held-out file cut into consecutive windows of at most ``context + 1`` tokens
    (inputs and the next-token targets), overlapping by one: every byte after a file's
    first is predicted once, from the bytes before it in its window."""
    for tokens in files:
        for start in range(0, len(tokens) - 1, context):
            yield tokens[start : start + context + 1]


# -- the model, in torch -------------------------------------------------------------


def _torch():
    try:
        import torch
    except ImportError as err:  # pragma: no cover - the extra is documented
        raise SystemExit(
            "training needs torch: pip install torch==2.13.0 (or 'nbkv[train]')"
        ) from err
    return torch


def _blocks(torch, c: LlamaConfig) -> tuple:
    """:func:`build_model`'s parts for ``c``: the ``RMSNorm``, ``Attention`` and ``MLP``
    module classes."""
    nn, F = torch.nn, torch.nn.functional

    def rotate(x, cos, sin):
        # rotary embedding, Hugging Face's "rotate half" form (what nbkv's rope kernel does)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    class RMSNorm(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))

        def forward(self, x):
            scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)
            return x * scale * self.weight

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            self.q_proj = nn.Linear(c.hidden_size, q_dim, bias=False)
            self.k_proj = nn.Linear(c.hidden_size, kv_dim, bias=False)
            self.v_proj = nn.Linear(c.hidden_size, kv_dim, bias=False)
            self.o_proj = nn.Linear(q_dim, c.hidden_size, bias=False)

        def forward(self, x, cos, sin):
            b, t, _ = x.shape
            q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
            k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
            v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            group = c.num_attention_heads // c.num_key_value_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
            self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
            self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    return RMSNorm, Attention, MLP


def build_model(config: LlamaConfig):
    """A torch Llama with Hugging Face's parameter names (what nbkv's Llama loads)."""
    torch = _torch()
    nn = torch.nn
    c = config
    RMSNorm, Attention, MLP = _blocks(torch, c)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.input_layernorm = RMSNorm(c.hidden_size)
            self.self_attn = Attention()
            self.post_attention_layernorm = RMSNorm(c.hidden_size)
            self.mlp = MLP()

        def forward(self, x, cos, sin):
            x = x + self.self_attn(self.input_layernorm(x), cos, sin)
            return x + self.mlp(self.post_attention_layernorm(x))

    class Body(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
            self.layers = nn.ModuleList(Layer() for _ in range(c.num_hidden_layers))
            self.norm = RMSNorm(c.hidden_size)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Body()
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
            inv = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim)
            self.register_buffer("inv_freq", inv, persistent=False)
            for name, p in self.named_parameters():
                if p.ndim == 2:  # GPT-2's init: N(0, 0.02), residual projections scaled down
                    std = (
                        0.02 / math.sqrt(2 * c.num_hidden_layers)
                        if name.endswith(("o_proj.weight", "down_proj.weight"))
                        else 0.02
                    )
                    nn.init.normal_(p, std=std)

        def forward(self, ids):
            t = ids.shape[1]
            angles = (
                torch.arange(t, dtype=torch.float32, device=ids.device)[:, None] * self.inv_freq
            )
            cos, sin = angles.cos(), angles.sin()
            x = self.model.embed_tokens(ids)
            for layer in self.model.layers:
                x = layer(x, cos, sin)
            return self.lm_head(self.model.norm(x))

    return Model()


def state_arrays(model) -> dict[str, np.ndarray]:
    """The model's weights as float32 NumPy arrays, by Hugging Face name."""
    return {n: p.detach().float().cpu().numpy() for n, p in model.named_parameters()}


# -- training --------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """Everything a run depends on (recorded in training.json)."""

    seed: int = 0
    context: int = 512
    batch: int = 16
    steps: int = 1600
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.1
    threads: int = 2
    eval_every: int = 250
    eval_limit: int = 0  # score only the first this many held-out windows (0: all of them)


def _lr(step: int, o: Options) -> float:
    """Linear warmup, then a cosine decay to a tenth of the peak."""
    if step < o.warmup:
        return o.lr * (step + 1) / o.warmup
    progress = (step - o.warmup) / max(1, o.steps - o.warmup)
    return o.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def bits_per_byte_windows(model, windows, batch: int = 16) -> float:
    """Mean bits per predicted byte of a torch model over ``windows`` (held_out_windows)."""
    torch = _torch()
    total_bits, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for w in windows:
            ids = torch.from_numpy(w.astype(np.int64))[None]
            logits = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits[0].float(), ids[0, 1:], reduction="sum")
            total_bits += float(loss) / math.log(2)
            count += ids.shape[1] - 1
    model.train()
    return total_bits / count


def _bar(step: int, steps: int, loss: float, rate: float, elapsed: float) -> str:
    done = int(30 * step / steps)
    eta = (steps - step) * elapsed / max(step, 1)
    return (
        f"\r[{'#' * done}{'.' * (30 - done)}] step {step}/{steps}  loss {loss:.3f} "
        f"({loss / math.log(2):.3f} bits/byte)  {rate:,.0f} tokens/s  "
        f"{elapsed / 60:.1f} min, {eta / 60:.1f} left"
    )


def train(options: Options, out: str | os.PathLike, *, corpus: Corpus | None = None, log=print):
    """Train, write the three files into ``out``; return the training record (a dict)."""
    torch = _torch()
    o = options
    torch.manual_seed(o.seed)
    torch.set_num_threads(o.threads)
    rng = np.random.default_rng(o.seed)
    corpus = corpus or load_corpus()
    config = DEFAULT_CONFIG
    model = build_model(config)
    decay = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=o.lr,
        betas=(0.9, 0.95),
    )
    data = corpus.train
    held = list(held_out_windows(corpus.held_out, o.context))
    if o.eval_limit:
        held = held[: o.eval_limit]
    log(
        f"corpus: {corpus.train_files} training files ({len(data):,} bytes), "
        f"{corpus.held_out_files} held out ({sum(len(h) for h in corpus.held_out):,} bytes), "
        f"from {corpus.root}"
    )
    started = time.perf_counter()
    losses: list[float] = []
    history = []
    for step in range(o.steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, o)
        starts = rng.integers(0, len(data) - o.context - 1, o.batch)
        window = np.stack([data[s : s + o.context + 1] for s in starts]).astype(np.int64)
        ids = torch.from_numpy(window)
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, config.vocab_size), ids[:, 1:].reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        elapsed = time.perf_counter() - started
        rate = (step + 1) * o.batch * o.context / elapsed
        if step % 10 == 0 or step == o.steps - 1:
            recent = float(np.mean(losses[-20:]))
            sys.stderr.write(_bar(step + 1, o.steps, recent, rate, elapsed))
            sys.stderr.flush()
        if o.eval_every and (step + 1) % o.eval_every == 0 and step + 1 < o.steps:
            bpb = bits_per_byte_windows(model, held[:64])
            history.append({"step": step + 1, "held_out_bits_per_byte_sample": round(bpb, 4)})
            log(f"\n  step {step + 1}: held-out sample {bpb:.3f} bits/byte")
    sys.stderr.write("\n")
    wall = time.perf_counter() - started
    held_bpb32 = bits_per_byte_windows(model, held)
    with torch.no_grad():  # what ships is float16: measure that
        for p in model.parameters():
            p.copy_(p.half().float())
    train_bpb = bits_per_byte_windows(
        model, [data[s : s + o.context + 1] for s in rng.integers(0, len(data) - o.context - 1, 64)]
    )
    held_bpb = bits_per_byte_windows(model, held)
    record = _record(o, corpus, torch.__version__, train_bpb, held_bpb, held_bpb32, wall, history)
    _write(out, model, config, record)
    log(
        f"done in {wall / 60:.1f} min: train {train_bpb:.3f}, held-out {held_bpb:.3f} bits/byte; "
        f"wrote {out}"
    )
    return record


def _record(o, corpus, torch_version, train_bpb, held_bpb, held_bpb32, wall, history) -> dict:
    """training.json's record of a run."""
    data = corpus.train
    return {
        "options": asdict(o),
        "corpus": {
            "root": corpus.root,
            "train_files": corpus.train_files,
            "train_bytes": int(len(data)),
            "held_out_files": corpus.held_out_files,
            "held_out_bytes": int(sum(len(h) for h in corpus.held_out)),
            "held_out_percent": HELD_OUT_PERCENT,
        },
        "python": platform.python_version(),
        "torch": torch_version,
        "steps": o.steps,
        "tokens_seen": o.steps * o.batch * o.context,
        "train_bits_per_byte": round(train_bpb, 4),  # 64 random windows, float16 weights
        "held_out_bits_per_byte": round(held_bpb, 4),  # every held-out window, float16
        "held_out_bits_per_byte_float32": round(held_bpb32, 4),  # before the rounding
        "wall_seconds": round(wall, 1),
        "history": history,
    }


def _write(out: str | os.PathLike, model, config: LlamaConfig, record: dict) -> None:
    from .._safetensors import save_file

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    weights = {n: a.astype(np.float16) for n, a in state_arrays(model).items()}
    save_file(weights, folder / "model.safetensors", {"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    (folder / "training.json").write_text(json.dumps(record, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nbkv.models.train",
        description="Train nbkv's default model on the standard library's Python files.",
    )
    d = Options()
    parser.add_argument("--out", default="nbkv-model", help="folder to write (default %(default)s)")
    for field, value in asdict(d).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    out = args.pop("out")
    train(Options(**args), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
