"""ViT-Tiny from scratch: patch embedding, class token, learned positions, pre-LayerNorm blocks
with (non-causal) multi-head attention and tanh-GELU MLP, final LayerNorm, a linear head on the
class token, mean cross-entropy over classes. AdamW row `constant_betas`.

True LayerNorm and GELU, composed by the engine from differentiable ops. The class token is
put in front of the patch tokens without concat (which has no backward in ggml 0.25.3): the
patch embeddings are shifted down one row by a constant 0/1 matrix (exact: one product per
output), and the class token is added to row 0. Step inputs, as in the seeds: `images`,
`cls_index` (the row of each image's class token in the flattened tokens) and `labels`.

Init: the seeded xorshift64 Box-Muller stream, standard deviation 0.02 * init_scale for
matrices, the class token and positions; LayerNorm gains 1, biases 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from toyharness import Options, blocks, choice, hookimpl, load_image_data, normal, positive, write_gguf

LN_EPS = 1e-5


@dataclass
class ViTOptions(Options):
    patch: int = positive(2)
    n_classes: int = 0          # 0: the largest label + 1
    n_layer: int = positive(3)
    d_model: int = positive(64)
    n_head: int = positive(4)
    d_ff: int = positive(128)
    t_batch: int = 64
    lr: float = 2e-3
    lr_schedule: str = choice("cosine", ("constant", "linear", "cosine"))
    warmup: int = 30
    steps: int = 900
    eval_every: int = 300
    checkpoint_every: int = 300


def param_shapes(o: ViTOptions, image_shape: tuple[int, int, int], n_classes: int) -> dict[str, tuple]:
    h, w, c = image_shape
    n_tokens = (h // o.patch) * (w // o.patch) + 1
    d, pdim = o.d_model, o.patch * o.patch * c
    shapes = {"patch_embd.weight": (d, pdim), "patch_embd.bias": (d,), "cls_token.weight": (d, 1),
              "position_embd.weight": (n_tokens, d)}
    for i in range(o.n_layer):
        b = f"blk.{i}."
        shapes |= {b + "attn_norm.weight": (d,), b + "attn_norm.bias": (d,)}
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            shapes |= {b + part + ".weight": (d, d), b + part + ".bias": (d,)}
        shapes |= {b + "ffn_norm.weight": (d,), b + "ffn_norm.bias": (d,), b + "ffn_up.weight": (o.d_ff, d),
                   b + "ffn_up.bias": (o.d_ff,), b + "ffn_down.weight": (d, o.d_ff), b + "ffn_down.bias": (d,)}
    shapes |= {"output_norm.weight": (d,), "output_norm.bias": (d,), "output.weight": (n_classes, d),
               "output.bias": (n_classes,)}
    return shapes


def init_params(o: ViTOptions, image_shape, n_classes: int) -> dict[str, np.ndarray]:
    P = {}
    for name, shape in param_shapes(o, image_shape, n_classes).items():
        if name.endswith("norm.weight"):
            P[name] = np.ones(shape, np.float32)
        elif name.endswith(".bias"):
            P[name] = np.zeros(shape, np.float32)
        else:
            P[name] = normal(o.seed, name, shape, 0.02 * o.init_scale)
    return P


def patchify(images, patch: int):
    """(B, H, W, C) -> (B, N, patch*patch*C), patches in row-major order, each (py, px, c)."""
    b, h, w, c = images.shape
    x = images.reshape(b * (h // patch), patch, w // patch, patch * c)
    x = x.permute(0, 2, 1, 3).cont()
    return x.reshape(b, (h // patch) * (w // patch), patch * patch * c)


class ViTModel:
    convention = "constant_betas"

    def __init__(self, engine, o: ViTOptions, image_shape, n_classes: int, params: dict[str, np.ndarray]):
        self.options, self.n_classes = o, n_classes
        prog = self.prog = engine.program()
        P = self.P = {name: prog.param(name, value) for name, value in params.items()}
        b, (h, w, c) = o.t_batch, image_shape
        n_patches = (h // o.patch) * (w // o.patch)
        images = prog.input("images", (b, h, w, c))
        cls_index = prog.input("cls_index", (b,), "i32", upper=b * (n_patches + 1))
        # shift[i + 1, i] = 1 moves patch i to token row i + 1 and leaves row 0 for the class
        # token. It acts on the pixels (an input): a permute's backward hands a non-contiguous
        # gradient to a broadcast add, whose backward (repeat_back) asserts on it in ggml 0.25.3.
        shift = prog.constant("shift", np.eye(n_patches + 1, n_patches, k=-1, dtype=np.float32))
        cls_row = prog.constant("cls_row", np.eye(n_patches + 1, 1, dtype=np.float32))       # (N+1, 1)
        patch_rows = prog.constant("patch_rows", 1 - np.eye(n_patches + 1, 1, dtype=np.float32))

        pixels = patchify(images, o.patch).permute(0, 2, 1).cont().matmul_t(shift).permute(0, 2, 1).cont()
        per_row = (blocks.linear(cls_row, P["cls_token.weight"])
                   + blocks.linear(patch_rows, P["patch_embd.bias"].reshape(o.d_model, 1))
                   + P["position_embd.weight"])                                          # (N+1, d)
        x = blocks.linear(pixels, P["patch_embd.weight"]) + per_row                       # (B, N+1, d)
        for i in range(o.n_layer):
            pre = f"blk.{i}."
            y = blocks.layer_norm(x, P[pre + "attn_norm.weight"], P[pre + "attn_norm.bias"], LN_EPS)
            x = x + blocks.attention(y, P[pre + "attn_q.weight"], P[pre + "attn_k.weight"], P[pre + "attn_v.weight"],
                                     P[pre + "attn_output.weight"], o.n_head, causal=False,
                                     bq=P[pre + "attn_q.bias"], bk=P[pre + "attn_k.bias"], bv=P[pre + "attn_v.bias"],
                                     bo=P[pre + "attn_output.bias"])
            y = blocks.layer_norm(x, P[pre + "ffn_norm.weight"], P[pre + "ffn_norm.bias"], LN_EPS)
            x = x + blocks.gelu_mlp(y, P[pre + "ffn_up.weight"], P[pre + "ffn_up.bias"], P[pre + "ffn_down.weight"],
                                    P[pre + "ffn_down.bias"])
        x = blocks.layer_norm(x, P["output_norm.weight"], P["output_norm.bias"], LN_EPS)
        cls_out = x.reshape(b * (n_patches + 1), o.d_model).get_rows(cls_index)       # (B, d)
        self.logits = blocks.linear(cls_out, P["output.weight"], P["output.bias"])    # (B, classes)
        self.trainer = prog.trainer(prog.cross_entropy(self.logits, "labels"), self.convention)
        self._eval = prog.forward({"logits": self.logits})

    def evaluate(self, batch: dict) -> dict:
        """Loss, correct count and confusion matrix over the batch's valid rows (float64 on host)."""
        valid = int(batch.get("valid", len(batch["labels"])))
        feeds = {k: v for k, v in batch.items() if k in ("images", "cls_index")}
        logits = self._eval.run(feeds)["logits"][:valid].astype(np.float64)
        labels = batch["labels"][:valid]
        logp = logits - logits.max(1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(1, keepdims=True))
        pred = logits.argmax(1)
        confusion = np.zeros((self.n_classes, self.n_classes), np.int64)
        np.add.at(confusion, (labels, pred), 1)
        return {"loss": float(-logp[np.arange(valid), labels].mean()), "correct": int((pred == labels).sum()),
                "count": valid, "confusion": confusion}


class ViTTiny:
    name = "vit_tiny"
    golden_sets = ["d_ff=48", "t_batch=4"]

    def torch_reference(self, options):
        """Its PyTorch twin (`bench` beside PyTorch, the parity tests); torch loads only here."""
        from .torch_twins.vit_tiny import ViTTinyTwin

        return ViTTinyTwin(options)

    @hookimpl
    def options(self):
        return ViTOptions

    @hookimpl
    def load_data(self, options):
        return load_image_data(options.data)

    @hookimpl
    def realize(self, engine, options, data):
        return ViTModel(engine, options, data.image_shape, data.n_classes,
                        init_params(options, data.image_shape, data.n_classes))

    @hookimpl
    def hp(self, options, step):
        return options.adamw_row().hp_for_step(step)

    @hookimpl
    def step(self, model, batch, hp):
        return model.trainer.step(batch, hp)

    @hookimpl
    def evaluate(self, model, batch):
        return model.evaluate(batch)

    @hookimpl
    def export(self, model, options, out_dir):
        o = options
        params = {name: model.prog.read(t) for name, t in model.P.items()}
        params["cls_token.weight"] = params["cls_token.weight"].reshape(-1)
        n_tokens = params["position_embd.weight"].shape[0]
        meta = {"vit.embedding_length": o.d_model, "vit.block_count": o.n_layer, "vit.attention.head_count": o.n_head,
                "vit.feed_forward_length": o.d_ff, "vit.attention.layer_norm_epsilon": LN_EPS,
                "vit.patch_size": o.patch, "vit.num_patches": n_tokens - 1, "vit.num_classes": model.n_classes,
                "vit.patch_embedding_length": params["patch_embd.weight"].shape[1],
                "general.name": "toyharness-vit_tiny"}
        return [write_gguf(Path(out_dir) / "model.gguf", "vit", params, meta)]


recipe = ViTTiny()
