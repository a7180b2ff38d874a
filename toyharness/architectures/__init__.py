"""The architectures a LoRA base or a warm-start donor may have, one module each (docs/design.md,
"GGUF names and architectures"): the GGUF keys and tensors it reads, its forward from the engine's blocks, and
its transformers counterpart (`hf_config`, for the parity tests).

| architecture | module | what differs from llama |
| --- | --- | --- |
| `llama` | llama.py | (Llama 2/3.x, SmolLM2; rope scaling `linear` and Llama 3's `rope_freqs`) |
| `qwen2` | llama.py | q/k/v biases, NeoX rope |
| `qwen3` | qwen3.py | per-head q/k RMSNorm, head size from `attention.key_length`, NeoX rope |
| `gemma3` | gemma3.py | scaled embeddings, q/k norms, post-norms, GeGLU, sliding-window layers |
| `phi3` | phi3.py | fused qkv and gate/up, partial NeoX rope |

`read_model(path)` is the one place the rule is enforced: every metadata key and tensor of the
file is read by its architecture's forward or is on `spec.KNOWN_NOT_FORWARD`; anything else
is refused by name (exit 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..engine.gguf_io import GGUFError, GGUFFile
from ..errors import InputError
from .gemma3 import GEMMA3
from .llama import LLAMA, QWEN2, Llama, llama3_rope_factors
from .phi3 import PHI3
from .qwen3 import QWEN3
from .spec import DecoderShape, Layer, ModelKeys, check_every_key_read, check_every_tensor_used

Architecture = Llama          # every architecture is a Llama subclass with its own parts
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (LLAMA, QWEN2, QWEN3, GEMMA3, PHI3)}
ALL_TARGETS = tuple(dict.fromkeys(t for a in ARCHITECTURES.values() for t in a.targets))

__all__ = ["ARCHITECTURES", "ALL_TARGETS", "Architecture", "DecoderShape", "GEMMA3", "LLAMA", "Layer", "ModelFile",
           "PHI3", "QWEN2", "QWEN3", "example_file", "example_shape", "llama3_rope_factors", "read_model",
           "write_example"]


@dataclass
class ModelFile:
    """A checked base or donor: its architecture, shape and every tensor's numpy shape."""

    path: Path
    arch: Architecture
    shape: DecoderShape
    tensors: dict[str, tuple[int, ...]]

    def target_tensor(self, layer: int, target: str) -> str:
        """The tensor a LoRA target adapts in `layer` (llama.cpp's name)."""
        stem = self.arch.targets.get(target)
        if stem is None:
            raise InputError(f"option 'targets': {target!r} is not a projection of {self.arch.name} bases "
                             f"({self.path.name}); they have {', '.join(self.arch.targets)}")
        return f"blk.{layer}.{stem}.weight"


def read_model(path: str | Path, role: str = "base") -> ModelFile:
    """Open a GGUF, read its architecture's keys and check every tensor's shape and type; every
    key and tensor the forward does not use is refused by name (the rule)."""
    with GGUFFile(path) as f:
        name = f.field("general.architecture")
        arch = ARCHITECTURES.get(name) if isinstance(name, str) else None
        if arch is None:
            raise GGUFError(f"{path}: architecture {name!r} is not supported as a {role}; supported: "
                            f"{', '.join(ARCHITECTURES)}")
        embd = f.tensor("token_embd.weight")
        if len(embd.shape) != 2:
            raise GGUFError(f"{path}: tensor 'token_embd.weight' has shape {embd.shape}, expected (vocab, width)")
        keys = ModelKeys(f, arch.name)
        shape = arch.read_shape(keys, embd.shape[0], f.names)
        want = arch.tensor_shapes(shape, f.names)
        check_every_key_read(keys, role)
        check_every_tensor_used(f, want, arch.name, role)
        for tensor, expected in want.items():
            info = f.tensor(tensor, expect_shape=expected)
            if len(expected) == 2:
                info.check_frozen()
            elif info.dtype != "f32":
                raise GGUFError(f"{path}: tensor {tensor!r} has type {info.dtype}, expected f32")
    return ModelFile(Path(path), arch, shape, want)


def example_shape(arch: str, n_layer: int = 2, d_model: int = 64, n_head: int = 4, n_kv_head: int = 2,
                  head_dim: int | None = None, d_ff: int = 128, vocab: int = 256, window: int | None = None,
                  rope_dims: int | None = None, rope_base: float = 10000.0, rope_scale: float = 1.0,
                  rope_factors: bool = False) -> DecoderShape:
    """A small model of `arch` with llama.cpp's defaults for the rest (tests, benchmarks)."""
    a = ARCHITECTURES[arch]
    hd = head_dim or d_model // n_head
    layers = [Layer(rope_base, rope_scale) for _ in range(n_layer)]
    s = DecoderShape(arch, n_layer, d_model, n_head, n_kv_head, hd, d_ff, vocab, 1e-6 if arch == "gemma3" else 1e-5,
                     layers, rope_dims or hd, a.rope_neox, "rope_freqs.weight" if rope_factors else None)
    if arch == "gemma3":
        s.embed_scale = float(np.sqrt(d_model))
        s.attn_scale = 1.0 / float(np.sqrt(hd))
        if window:
            for i, lay in enumerate(layers):
                if i % 6 < 5:
                    lay.window, lay.rope_base, lay.rope_scale = window, 10000.0, 1.0
    elif arch == "phi3" and window:
        s.max_seq = window
    return s


def example_tensors(s: DecoderShape, seed: int = 7, std: float = 0.1) -> dict[str, np.ndarray]:
    """Seeded weights for every tensor of `s` (the xorshift normal stream of toyharness.seeded_init):
    matrices N(0, std), norm gains 1 + N(0, 0.1) (so that a misplaced gain shows), biases
    N(0, 0.1), and Llama 3.2's rope frequency table where the shape has one."""
    from ..seeded_init import normal, with_values

    arch = ARCHITECTURES[s.arch]
    out = {}
    with with_values():      # written to files: never a memory plan's placeholders
        return _example_tensors(arch, s, seed, std, normal, out)


def _example_tensors(arch, s: DecoderShape, seed: int, std: float, normal, out: dict) -> dict[str, np.ndarray]:
    names = ["output.weight"] if s.extras.get("untied") else []
    for name, shape in arch.tensor_shapes(s, names).items():
        if name == s.rope_factors:
            out[name] = llama3_rope_factors(s.rope_dims, s.layers[0].rope_base)
        elif len(shape) == 2:
            out[name] = normal(seed, name, shape, std)
        elif name.endswith("norm.weight"):
            out[name] = (1.0 + normal(seed, name, shape, 0.1)).astype(np.float32)
        else:
            out[name] = normal(seed, name, shape, 0.1)
    return out


def write_example(path: str | Path, s: DecoderShape, seed: int = 7, std: float = 0.1,
                  tensors: dict[str, np.ndarray] | None = None, extra_meta: dict | None = None) -> Path:
    """A GGUF of architecture `s.arch` laid out as llama.cpp's converter writes it, with the byte
    tokenizer (ids 0-255): a model of that architecture the tests and benchmarks can make."""
    from ..engine import write_gguf
    from ..lm import tokenizer_metadata

    arch = ARCHITECTURES[s.arch]
    # a name without the architecture's: llama.cpp picks vocabulary rules by name ("phi3": Phi-3's tokens)
    meta = {**arch.metadata(s), **tokenizer_metadata(s.vocab), "general.name": "toyharness-example",
            **(extra_meta or {})}
    return write_gguf(path, s.arch, tensors or example_tensors(s, seed, std), meta)


def example_file(seed: int = 7, **shape_args) -> Path:
    """`write_example` of `example_shape(**shape_args)` kept in the cache (as lm.seeded_model_file):
    the same bytes on every machine, so that goldens and benchmarks can use it as a base."""
    import hashlib

    from ..lm import cache_root

    key = hashlib.sha256(repr((sorted(shape_args.items()), seed)).encode()).hexdigest()[:12]
    path = cache_root() / "models" / f"example-{shape_args.get('arch', 'llama')}-{key}.gguf"
    if not path.is_file():
        write_example(path, example_shape(**shape_args), seed)
    return path
