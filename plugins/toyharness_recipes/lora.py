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
from typing import ClassVar

import numpy as np

from toyharness import (
    ALL_TARGETS,
    ARCHITECTURES,
    CONVENTIONS,
    GGUFFile,
    InputError,
    LMOptions,
    LMRecipe,
    ModelFile,
    blocks,
    cached_copy_as,
    choice,
    example_file,
    hookimpl,
    normal,
    positive,
    probability,
    read_model,
    seeded_model_file,
    synthetic_instruction_file,
    write_gguf,
)

# lora@packed and llama@packed: short synthetic instructions, about two to a row of the golden
# config's 24 positions (toyharness/data/instructions.py), some cut at the row's end
PACKED_GOLDEN_DATA = dict(n=64, seed=0, median=12, sigma=0.6, shortest=4, longest=40)

# lora@llama3, lora@qwen3, lora@gemma3, lora@phi3: the golden config over a seeded base of each
ARCH_GOLDEN_BASES = {
    "llama3": dict(arch="llama", n_layer=1, d_model=32, n_head=2, n_kv_head=1, d_ff=48, rope_factors=True,
                   rope_base=500000.0),
    "qwen3": dict(arch="qwen3", n_layer=1, d_model=32, n_head=2, n_kv_head=1, head_dim=32, d_ff=48),
    "gemma3": dict(arch="gemma3", n_layer=6, d_model=32, n_head=2, n_kv_head=1, head_dim=32, d_ff=48, window=4,
                   rope_base=1e6),
    "phi3": dict(arch="phi3", n_layer=1, d_model=32, n_head=2, n_kv_head=1, d_ff=48, rope_dims=8, window=64),
}


@dataclass
class AdapterOptions(LMOptions):
    """The keys of LoRA adapters on a frozen GGUF base, shared by every adapter recipe (lora, dpo,
    orpo)."""

    # the memory plan halves these too when it says what would shrink a run (toyharness/engine/memory_plan.py)
    plan_sizes: ClassVar[tuple[str, ...]] = ("rank",)
    base: str = ""
    rank: int = positive(8)
    alpha: float = 16.0
    targets: tuple[str, ...] = choice(("q",), ALL_TARGETS)
    merged: bool = False
    t_seq: int = 64
    t_batch: int = 16
    lr: float = 2e-3
    beta2: float = 0.999
    adamw_convention: str = choice("bias_corrected", CONVENTIONS)
    lr_schedule: str = choice("cosine", ("constant", "linear", "cosine"))
    warmup: int = 10
    steps: int = 200
    eval_every: int = 50
    checkpoint_every: int = 50
    # recompute each block's activations in the backward (engine/recompute.py): less memory, the
    # same losses bit for bit, one more forward of the blocks per step (cpu and cuda; llama-family
    # bases, whose blocks go through blocks.recomputed_block)
    recompute_blocks: bool = False
    # dropout on each adapter's input, where PEFT puts it: B(A(dropout(x))) * alpha / rank (the base's
    # product reads x itself); 0 builds no dropout node
    lora_dropout: float = probability(0.0)
    # positions whose output logits the loss makes at a time, recomputed in the backward (0: all
    # at once). On a large vocabulary every position's logits, softmax and their gradients are most
    # of a step's memory; pieces of 256 keep one piece's (cpu and cuda; lora: before chunked_loss=auto)
    logits_chunk: int = 0

    def validate(self) -> None:
        super().validate()
        if self.logits_chunk < 0:
            raise self.invalid("logits_chunk", f"must be >= 0 positions (0: all at once), got {self.logits_chunk}")


@dataclass
class LoRAOptions(AdapterOptions):
    # the loss over the base's vocabulary a tile at a time (toyharness.lm.use_chunked_loss):
    # auto = from 4,096 classes on cpu (every real vocabulary), on, off
    chunked_loss: str = choice("auto", ("auto", "on", "off"))

    def validate(self) -> None:
        super().validate()
        if self.logits_chunk and self.chunked_loss == "on":
            raise self.invalid("logits_chunk", "and chunked_loss=on are two ways to the same saving; set one "
                                               "(logits_chunk=0 or chunked_loss=off)")


def read_base(path: str, recipe: str = "lora") -> ModelFile:
    """Open and check a base GGUF of any architecture of toyharness.architectures; every problem
    names the file and the key or tensor."""
    if not path:
        raise InputError(f"{recipe} needs a base model: --set base=PATH.gguf (a llama, qwen2, qwen3, gemma3 or phi3 "
                         "GGUF)")
    return read_model(path, "base")


class AdapterRecipe(LMRecipe):
    """LoRA adapters on a frozen GGUF base (`AdapterOptions`): the base, the adapters' init, the
    weights the forward reads, the forward, `fuse` and the export. lora trains them on
    cross-entropy; dpo and orpo (preference.py) on preference pairs."""

    options_class = AdapterOptions

    def __init__(self):
        self._bases: dict[str, ModelFile] = {}

    def base(self, o: AdapterOptions) -> ModelFile:
        if o.base not in self._bases:
            self._bases[o.base] = read_base(o.base, self.name)
        base = self._bases[o.base]
        if base.shape.max_seq and o.t_seq > base.shape.max_seq:
            raise InputError(f"option 't_seq': {o.t_seq} is longer than {base.shape.max_seq}: {base.shape.max_seq_why}")
        return base

    def tokenizer_file(self, o: AdapterOptions) -> str:
        """The data is read with the base's own tokenizer (bytes for bases the harness made)."""
        if o.tokenizer and o.tokenizer != o.base:
            raise InputError(f"{self.name} reads its data with the base's tokenizer: leave option 'tokenizer' unset")
        self.base(o)                   # a missing or bad base is named first
        return o.base

    def vocab_for(self, o: AdapterOptions, data_vocab: int) -> int:
        base = self.base(o)
        if data_vocab > base.shape.vocab:
            raise InputError(f"{self.name}: the data has token ids up to {data_vocab - 1} but the base {o.base} has "
                             f"a vocabulary of {base.shape.vocab}")
        return base.shape.vocab

    def init_params(self, o: AdapterOptions, vocab: int) -> dict[str, np.ndarray]:
        if o.rank <= 0:
            raise InputError(f"option 'rank': must be > 0, got {o.rank}")
        base, P = self.base(o), {}
        for i in range(base.shape.n_layer):
            for t in o.targets:
                name = base.target_tensor(i, t)
                out_dim, in_dim = base.tensors[name]
                P[name + ".lora_a"] = normal(o.seed, name + ".lora_a", (o.rank, in_dim), o.init_scale / np.sqrt(in_dim))
                P[name + ".lora_b"] = np.zeros((out_dim, o.rank), np.float32)
        return P

    def build_params(self, prog, o: AdapterOptions, vocab, values, trainable):
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
                name = base.target_tensor(i, t)
                P[name] = blocks.LoRAWeight(P[name], P[name + ".lora_a"], P[name + ".lora_b"], scale,
                                            o.lora_dropout, f"dropout.{name}.lora")
        return P

    def reference_params(self, P: dict) -> dict:
        """The weights with the adapters left out: the frozen base alone (the reference policy of
        preference training), the same tensors, no copy."""
        return {name: w.base if isinstance(w, blocks.LoRAWeight) else w for name, w in P.items()}

    def forward(self, P, tokens, positions, o: AdapterOptions):
        return self.head(P, self.hidden(P, tokens, positions, o), o)

    def hidden(self, P, tokens, positions, o: AdapterOptions):
        tokens.prog.dropout_seed = o.seed
        base = self.base(o)
        return base.arch.hidden(P, P["token_embd.weight"].get_rows(tokens), positions, base.shape)

    def head(self, P, h, o: AdapterOptions):
        base = self.base(o)
        return base.arch.head(P, h, base.shape)

    def fuse_adapters(self, o: AdapterOptions, checkpoint: Path):
        """`toyharness fuse`: each adapted weight of the base gains (alpha / rank) B A."""
        from toyharness import AdapterFold

        base = self.base(o)
        adapters = self.params_for_sampling(checkpoint, o, base.shape.vocab)
        scale = np.float32(o.alpha / o.rank)
        adapted = frozenset(name[: -len(".lora_a")] for name in adapters if name.endswith(".lora_a"))
        return AdapterFold(base.path, base.arch.name, adapted,
                           lambda name: scale * (adapters[name + ".lora_b"] @ adapters[name + ".lora_a"]), "lora",
                           {"toyharness.fuse.rank": int(o.rank), "toyharness.fuse.alpha": float(o.alpha),
                            "toyharness.fuse.targets": ",".join(o.targets)})

    @hookimpl
    def export(self, model, options, out_dir):
        o, base = options, self.base(options)
        adapters = {name: model.prog.read(t) for name, t in model.prog.params.items()}
        written = [write_gguf(Path(out_dir) / "adapter.gguf", base.arch.name, adapters,
                              {"general.type": "adapter", "adapter.type": "lora", "adapter.lora.alpha": float(o.alpha),
                               "general.name": "toyharness-lora"})]
        if o.merged:
            written.append(write_merged(Path(out_dir) / "model.gguf", base, adapters, o.alpha / o.rank))
        return written


class LoRA(AdapterRecipe):
    name = "lora"
    options_class = LoRAOptions

    def torch_reference(self, options):
        """Its PyTorch twin (`bench` beside PyTorch, the parity tests); torch loads only here."""
        from .torch_twins.lora import LoRATwin

        if options.lora_dropout:
            raise InputError("option 'lora_dropout': the PyTorch twin has no dropout; set lora_dropout=0")
        return LoRATwin(options)

    # Golden and bench bases: the llama recipe's seeded init, written once to the cache
    # (toyharness.lm.seeded_model_file), so the same base bytes exist on every machine.
    @property
    def golden_sets(self) -> list[str]:
        base = seeded_model_file("llama", ["n_layer=1", "d_model=32", "n_head=2", "n_kv_head=1", "d_ff=48", "seed=7"])
        return [f"base={base}", "targets=q,v,down", "rank=4", "alpha=8"]

    @property
    def golden_variants(self) -> dict[str, list[str]]:
        """lora@q4_k, lora@q8_0: the golden config over a quantized base (a seeded llama 256 wide,
        so that K-quants fit its rows, quantized by ggml's own quantizer and kept in the cache);
        lora@dropout: the golden config with lora_dropout 0.1; lora@packed: the golden config on JSONL
        instructions packed several to a row; lora@accum: two micro-batches a step, and lora@dp2 the
        same in two processes (the same bits)."""
        base = seeded_model_file("llama", ["n_layer=1", "d_model=256", "n_head=4", "n_kv_head=2", "d_ff=512",
                                           "seed=7"])
        variants = {dtype: [f"base={cached_copy_as(base, dtype)}"] for dtype in ("q4_k", "q8_0")}
        # one per base architecture (toyharness/architectures), small and seeded; each its own targets
        for name, shape in ARCH_GOLDEN_BASES.items():
            arch = ARCHITECTURES[shape["arch"]]
            variants[name] = [f"base={example_file(**shape)}", f"targets={','.join(arch.targets)}"]
        variants["dropout"] = ["lora_dropout=0.1"]
        variants["packed"] = [f"data={synthetic_instruction_file(**PACKED_GOLDEN_DATA)}", "pack=true"]
        variants["accum"], variants["dp2"] = ["accumulate=2"], ["devices=2"]
        return variants

    @property
    def bench_sets(self) -> list[str]:
        return [f"base={seeded_model_file('llama', [])}"]      # llama's default size


def write_merged(path: Path, base: ModelFile, adapters: dict[str, np.ndarray], scale: float) -> Path:
    """The base with W + scale * B @ A folded in (f32), its metadata copied."""
    with GGUFFile(base.path) as f:
        tensors = {}
        for name in f.names:
            w = f.tensor(name).to_numpy()
            if name + ".lora_a" in adapters:
                w = w + scale * (adapters[name + ".lora_b"] @ adapters[name + ".lora_a"])
            tensors[name] = w.astype(np.float32)
        meta = {k: v for k, v in f.metadata().items() if k != "general.architecture"}
    return write_gguf(path, base.arch.name, tensors, meta)


recipe = LoRA()
