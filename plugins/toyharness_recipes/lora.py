"""LoRA on a frozen GGUF base: rank-r adapters on chosen projections of a llama-family model.

The base is any llama.cpp `llama` (or, with Q/K/V biases, `qwen2`) GGUF: tied or untied output,
grouped-query heads, matrices of any frozen type (engine/quant.py: f32, f16, bf16, q8_0, q4_0,
q4_1, q5_0, q5_1, q4_k, q5_k, q6_k) and f32 norm weights; other types are refused with an error
naming the file, the tensor and the type. The base is frozen, kept in its own types and, on cpu,
mmap'd and used in place; its products compute in f32 from the dequantized weights
(tests/test_quant.py trains through each type).

Adapters: W x + (alpha / rank) * B (A x) on each target (q, k, v, o, gate, up, down). Init:
A from the seeded xorshift64 Box-Muller stream with standard deviation init_scale/sqrt(d_in),
B zero, so step 0 sees the base model exactly. Only adapters and their AdamW moments train;
AdamW row `bias_corrected`, beta2 0.999. Export: `adapter.gguf` in llama.cpp's LoRA adapter
format, and with `merged=true` a `model.gguf` with the adapters folded into the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from toyharness.engine import GGUFFile, blocks, write_gguf
from toyharness.engine.gguf_io import GGUFError, cached_copy_as
from toyharness.errors import InputError
from toyharness.hookspecs import hookimpl
from toyharness.init import normal
from toyharness.lm import LMRecipe, seeded_model_file
from toyharness.options import CONVENTIONS, Options, choice
from toyharness_recipes.llama import LlamaShape, llama_forward

TARGETS = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up",
           "down": "ffn_down"}
ARCHS = ("llama", "qwen2")


@dataclass
class LoRAOptions(Options):
    base: str = ""
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = choice(("q",), tuple(TARGETS))
    merged: bool = False
    t_seq: int = 64
    t_batch: int = 16
    lr: float = 2e-3
    beta2: float = 0.999
    adamw_convention: str = choice("bias_corrected", CONVENTIONS)
    lr_schedule: str = choice("cosine", ("constant", "cosine"))
    warmup: int = 10
    steps: int = 200
    eval_every: int = 50
    checkpoint_every: int = 50


@dataclass
class BaseModel:
    """A validated llama-family GGUF: its shape and the numpy shape of every tensor it must hold."""

    path: Path
    arch: str
    shape: LlamaShape
    d_model: int
    d_ff: int
    vocab: int
    tensors: dict[str, tuple[int, ...]]

    def target_shape(self, layer: int, target: str) -> tuple[int, int]:
        return self.tensors[f"blk.{layer}.{TARGETS[target]}.weight"]


def llama_tensor_shapes(n_layer: int, d: int, kv: int, d_ff: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """The numpy shape of every tensor a llama GGUF holds (llama.cpp's names; untied output and
    qwen2 biases are the caller's), with `kv` the width of K and V."""
    shapes = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,)}
    for i in range(n_layer):
        b = f"blk.{i}."
        shapes |= {b + "attn_norm.weight": (d,), b + "attn_q.weight": (d, d), b + "attn_k.weight": (kv, d),
                   b + "attn_v.weight": (kv, d), b + "attn_output.weight": (d, d), b + "ffn_norm.weight": (d,),
                   b + "ffn_gate.weight": (d_ff, d), b + "ffn_up.weight": (d_ff, d), b + "ffn_down.weight": (d, d_ff)}
    return shapes


def read_base(path: str) -> BaseModel:
    """Open and check a base GGUF; every problem names the file, the tensor and expected vs got."""
    if not path:
        raise InputError("lora needs a base model: --set base=PATH.gguf (a llama or qwen2 GGUF)")
    with GGUFFile(path) as f:
        arch = f.field("general.architecture")
        if arch not in ARCHS:
            raise GGUFError(f"{path}: architecture {arch!r}, expected one of {', '.join(ARCHS)}")

        def key(name, kind=int, default=None):
            value = f.require_field(f"{arch}.{name}") if default is None else f.field(f"{arch}.{name}", default)
            if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) or \
                    (kind is int and value <= 0):
                raise GGUFError(f"{path}: metadata {arch}.{name} is {value!r}, expected a positive {kind.__name__}")
            return kind(value)

        n_layer, d, n_head = key("block_count"), key("embedding_length"), key("attention.head_count")
        n_kv, d_ff = key("attention.head_count_kv", default=n_head), key("feed_forward_length")
        # Each layer has 9 tensors: a count beyond the file's is damage, not a model to loop over.
        if n_layer > len(f.names) or d % n_head or n_head % n_kv:
            raise GGUFError(f"{path}: inconsistent sizes: {n_layer} layers in {len(f.names)} tensors, width {d}, "
                            f"{n_head} heads, {n_kv} kv heads")
        shape = LlamaShape(n_layer, n_head, n_kv, key("attention.layer_norm_rms_epsilon", float),
                           key("rope.freq_base", float, 10000.0), rope_neox=(arch == "qwen2"))
        vocab = f.tensor("token_embd.weight").shape[0]
        kv = n_kv * (d // n_head)
        want = llama_tensor_shapes(n_layer, d, kv, d_ff, vocab)
        for i in range(n_layer):
            b = f"blk.{i}."
            if arch == "qwen2":
                want |= {b + "attn_q.bias": (d,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)}
        if "output.weight" in f.names:
            want["output.weight"] = (vocab, d)
        for name, expected in want.items():
            info = f.tensor(name, expect_shape=expected)
            if len(expected) == 2:
                info.check_frozen()
            elif info.dtype != "f32":
                raise GGUFError(f"{path}: tensor {name!r} has type {info.dtype}, expected f32")
    return BaseModel(Path(path), arch, shape, d, d_ff, vocab, want)


class LoRA(LMRecipe):
    name = "lora"
    options_class = LoRAOptions

    # Golden and bench bases: the llama recipe's seeded init, written once to the cache
    # (toyharness.lm.seeded_model_file), so the same base bytes exist on every machine.
    @property
    def golden_sets(self) -> list[str]:
        base = seeded_model_file("llama", ["n_layer=1", "d_model=32", "n_head=2", "n_kv_head=1", "d_ff=48", "seed=7"])
        return [f"base={base}", "targets=q,v,down", "rank=4", "alpha=8"]

    @property
    def golden_variants(self) -> dict[str, list[str]]:
        """lora@q4_k, lora@q8_0: the golden config over a quantized base (a seeded llama 256 wide,
        so that K-quants fit its rows, quantized by ggml's own quantizer and kept in the cache)."""
        base = seeded_model_file("llama", ["n_layer=1", "d_model=256", "n_head=4", "n_kv_head=2", "d_ff=512",
                                           "seed=7"])
        return {dtype: [f"base={cached_copy_as(base, dtype)}"] for dtype in ("q4_k", "q8_0")}

    @property
    def bench_sets(self) -> list[str]:
        return [f"base={seeded_model_file('llama', [])}"]      # llama's default size

    def __init__(self):
        self._bases: dict[str, BaseModel] = {}

    def base(self, o: LoRAOptions) -> BaseModel:
        if o.base not in self._bases:
            self._bases[o.base] = read_base(o.base)
        return self._bases[o.base]

    def tokenizer_file(self, o: LoRAOptions) -> str:
        """The data is read with the base's own tokenizer (bytes for bases the harness made)."""
        if o.tokenizer and o.tokenizer != o.base:
            raise InputError("lora reads its data with the base's tokenizer: leave option 'tokenizer' unset")
        self.base(o)                   # a missing or bad base is named first
        return o.base

    def vocab_for(self, o: LoRAOptions, data_vocab: int) -> int:
        base = self.base(o)
        if data_vocab > base.vocab:
            raise InputError(f"lora: the data has token ids up to {data_vocab - 1} but the base {o.base} has "
                             f"a vocabulary of {base.vocab}")
        return base.vocab

    def init_params(self, o: LoRAOptions, vocab: int) -> dict[str, np.ndarray]:
        if o.rank <= 0:
            raise InputError(f"option 'rank': must be > 0, got {o.rank}")
        base, P = self.base(o), {}
        for i in range(base.shape.n_layer):
            for t in o.targets:
                out_dim, in_dim = base.target_shape(i, t)
                name = f"blk.{i}.{TARGETS[t]}.weight"
                P[name + ".lora_a"] = normal(o.seed, name + ".lora_a", (o.rank, in_dim), o.init_scale / np.sqrt(in_dim))
                P[name + ".lora_b"] = np.zeros((out_dim, o.rank), np.float32)
        return P

    def build_params(self, prog, o: LoRAOptions, vocab, values, trainable):
        base = self.base(o)
        gguf = GGUFFile(base.path)
        prog._keepalive.append(gguf)         # mmap'd weights live as long as the program
        P = {}
        for name, shape in base.tensors.items():
            P[name] = prog.frozen_gguf(gguf, name, expect_shape=shape)
        scale = o.alpha / o.rank
        for name, value in values.items():
            P[name] = prog.param(name, value, trainable=trainable)
        for i in range(base.shape.n_layer):
            for t in o.targets:
                name = f"blk.{i}.{TARGETS[t]}.weight"
                P[name] = blocks.LoRAWeight(P[name], P[name + ".lora_a"], P[name + ".lora_b"], scale)
        return P

    def forward(self, P, tokens, positions, o: LoRAOptions):
        return llama_forward(P, P["token_embd.weight"].get_rows(tokens), positions, self.base(o).shape)

    @hookimpl
    def export(self, model, options, out_dir):
        o, base = options, self.base(options)
        adapters = {name: model.prog.read(t) for name, t in model.prog.params.items()}
        written = [write_gguf(Path(out_dir) / "adapter.gguf", base.arch, adapters,
                              {"general.type": "adapter", "adapter.type": "lora", "adapter.lora.alpha": float(o.alpha),
                               "general.name": "toyharness-lora"})]
        if o.merged:
            written.append(write_merged(Path(out_dir) / "model.gguf", base, adapters, o.alpha / o.rank))
        return written


def write_merged(path: Path, base: BaseModel, adapters: dict[str, np.ndarray], scale: float) -> Path:
    """The base with W + scale * B @ A folded in (f32), its metadata copied."""
    with GGUFFile(base.path) as f:
        tensors = {}
        for name in f.names:
            w = f.tensor(name).to_numpy()
            if name + ".lora_a" in adapters:
                w = w + scale * (adapters[name + ".lora_b"] @ adapters[name + ".lora_a"])
            tensors[name] = w.astype(np.float32)
        meta = {k: v for k, v in f.metadata().items() if k != "general.architecture"}
    return write_gguf(path, base.arch, tensors, meta)


recipe = LoRA()
