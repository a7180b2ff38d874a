"""What toyharness's command line takes: every command's flags and help (build_parser), the
messages for arguments it does not take. The commands themselves are in toyharness/cli.py."""

from __future__ import annotations

import argparse
import sys

# toyharness.engine.backend.KNOWN_BACKENDS, without loading the native libraries for --help
BACKENDS = ("cpu", "cuda", "vulkan", "metal")
# toyharness.merge_adapters.FUSE_TYPES, for the same reason
FUSE_TYPES = ("same", "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse exits 2 too; keep its one-line style
        self.print_usage(sys.stderr)
        self.exit(2, f"toyharness: error: {message}\n")

    def parse_args(self, args=None, namespace=None):
        """argparse hands a subcommand's unknown flags up to the top level, whose error shows the
        top level's usage; they are the subcommand's mistake, so its parser reports them."""
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            target = self._chosen_subparser(namespace) or self
            target.error(unknown_arguments_message(target, extras))
        return namespace

    def _chosen_subparser(self, namespace) -> argparse.ArgumentParser | None:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(getattr(namespace, action.dest, None))
        return None


def unknown_arguments_message(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """One line naming the flags `parser` does not take, with the closest flag it does take where
    one is close (a typo: --stpes for --steps)."""
    import difflib

    flags = [a.split("=", 1)[0] for a in extras if a.startswith("-") and len(a) > 1 and not _is_number(a)]
    if not flags:
        return f"unrecognized arguments: {' '.join(extras)}"
    # compared without their dashes, which every flag shares (with them --bogus is "close" to --out)
    known = {s.lstrip("-"): s for action in parser._actions for s in action.option_strings}
    guesses = {f: [known[g] for g in difflib.get_close_matches(f.lstrip("-"), known, n=1)] for f in flags}
    message = f"unknown flag{'s' if len(flags) > 1 else ''} {', '.join(flags)} for {parser.prog}"
    close = [(f, g[0]) for f, g in guesses.items() if g]
    if not close:
        return f"{message} (`{parser.prog} --help` lists its flags)"
    if len(flags) == 1:
        return f"{message}; did you mean {close[0][1]}?"
    return f"{message}; did you mean " + ", ".join(f"{g} for {f}" for f, g in close) + "?"


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


SWEEP_DESCRIPTION = """\
Run RECIPE once per point: each combination of the --grid values, with each seed.
A point is an ordinary run, with its run folder under DIR/points/ and the same losses,
bit for bit, as `toyharness run` with its options. Every point's options are checked
before anything runs. Writes DIR/sweep.json (grid, seeds, each point's options, status,
final and best eval loss) and DIR/sweep.png (loss per configuration: mean over seeds,
band min-max), and prints the configurations sorted by mean final eval loss.
Exit 1 if a point failed (the others go on).

examples:
  toyharness sweep llama --grid lr=1e-3,3e-3 --grid d_model=64,128 --seeds 3 --steps 200
  toyharness sweep lora --grid 'targets=q,v;q,k,v,o' --set base=runs/base/model.gguf
  toyharness sweep --resume sweeps/llama-20260101-120000        # after a stop or a kill
  toyharness sweep llama --grid lr=1e-3,3e-3 --threads 4 --ray HEAD:6379   # on a Ray cluster
"""


BACKEND_HELP = ("where ggml computes (default cpu); cuda and vulkan if this build has them "
                "(TOYHARNESS_BACKENDS at install), metal on macOS")
THREADS_HELP = "cpu threads (default: free cores)"
NO_PROGRESS_HELP = "no progress display (for logs and CI)"
DEBUG_HELP = "on an error, print its traceback (with the recipe's own frames) before the one-line message"
LOG_HELP = ("observers to log to (toyharness.observers entry points, listed by `toyharness recipes`): "
            "tensorboard, mlflow, or a plugin's; the option `log`")


def add_shared_flags(parser: argparse.ArgumentParser, *, backend: bool = True, backend_default: str | None = "cpu",
                     backend_help: str = BACKEND_HELP, threads: bool = True, threads_help: str = THREADS_HELP,
                     progress: bool = True, progress_help: str = NO_PROGRESS_HELP, out_help: str | None = None,
                     out_metavar: str | None = None) -> None:
    """The flags that mean the same thing in every command that takes them: --backend, --threads,
    --no-progress and --out (only where a command writes something, with its own help: what it writes)."""
    if backend:
        parser.add_argument("--backend", default=backend_default, choices=BACKENDS, help=backend_help)
    if threads:
        parser.add_argument("--threads", type=int, help=threads_help)
    if progress:
        parser.add_argument("--no-progress", action="store_true", help=progress_help)
    if out_help is not None:
        parser.add_argument("--out", metavar=out_metavar, help=out_help)


def build_parser() -> argparse.ArgumentParser:
    from .bench import SIZES

    p = _Parser(prog="toyharness", description="Small, deterministic training experiments on ggml.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    # recipes reads entry points and computes nothing: none of the shared flags
    sub.add_parser("recipes", help="list installed recipes and observers (name, distribution, version) and base "
                                   "architectures",
                   description="List every recipe found through the toyharness.recipes entry points, the "
                               "GGUF architectures lora and warm_start take as a base or donor, and the observers "
                               "(loggers, trackers; toyharness.observers entry points) that --log enables.")

    r = sub.add_parser("run", help="train a recipe and write a run folder",
                       description="Train RECIPE and write its run folder (config.toml, metrics.jsonl, "
                                   "summary.json, loss.png, checkpoint.gguf, model.gguf).",
                       epilog="training-loop options (--set, all off by default): accumulate=K sums the gradients "
                              "of K micro-batches of t_batch rows per optimizer step (the rows of one t_batch*K "
                              "batch); grad_clip=C clips each step's gradient to global L2 norm C, as PyTorch's "
                              "clip_grad_norm_ (metrics.jsonl's grad_norm); lr_schedule=constant|linear|cosine "
                              "with warmup=N and min_lr=LR (the decay's floor; unset: lr/10, nanoGPT's default); "
                              "weight_decay applies to matrices and embeddings only; devices=N spreads each step "
                              "over N processes with accumulate=N's bits (MPI: the run starts mpiexec -n N itself "
                              "unless a launcher started it). `--set bogus=1` lists every option of the recipe.")
    r.add_argument("recipe", help="an installed recipe (`toyharness recipes` lists them)")
    r.add_argument("--steps", type=int, help="number of training steps (default: the recipe's)")
    add_shared_flags(r, backend_default=None,
                     backend_help=BACKEND_HELP.replace("(default cpu)", "(default cpu; with --resume, the run's)"),
                     progress_help="no progress bar", out_help="run folder (default: runs/RECIPE-TIMESTAMP)")
    r.add_argument("--config", help="TOML file of options")
    r.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="set one option (repeatable; wins over --config)")
    r.add_argument("--save-init", action="store_true", help="write init.gguf: every parameter before step 0")
    r.add_argument("--save-batches", action="store_true", help="write batches.npz: every step's exact inputs")
    r.add_argument("--resume", metavar="RUN_DIR",
                   help="continue RUN_DIR from its checkpoint, bit for bit, on its backend and precision (a "
                        "--backend or --set precision=... given here wins, and is named on stderr)")
    r.add_argument("--log", action="append", metavar="NAME[,NAME]", help=LOG_HELP)
    r.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    # a process toyharness/launcher.py started: the run's summary is printed by the one that started it
    r.add_argument("--spread-process", action="store_true", help=argparse.SUPPRESS)
    r.add_argument("--plan", action="store_true",
                   help="print the run's memory plan (parameters, moments, frozen weights, activations, the largest "
                        "tensors) beside the backend's free memory, and exit without training")

    g = sub.add_parser("golden", help="check or record golden losses",
                       description="Compare each recipe's first 16 losses with goldens/<fingerprint>/, bit for bit.")
    g.add_argument("action", choices=["check", "record"],
                   help="check: run each golden config and compare (exit 1 on a mismatch, naming the first "
                        "diverging step); record: rewrite the golden files (intentional changes only)")
    g.add_argument("recipes", nargs="*", help="recipes, or RECIPE@VARIANT for a recipe's extra golden config "
                                              "(e.g. lora@q4_k); default: every installed recipe and its variants")
    add_shared_flags(g, threads_help="cpu threads of each golden run (default: free cores; the bits do not depend "
                                     "on it)",
                     progress_help="as in every command; golden draws no progress display to turn off (one line per "
                                   "golden as each finishes)")
    g.add_argument("--verbose", action="store_true",
                   help="check: list each recipe variant with no golden here, one per line (default: their count)")
    g.add_argument("--dir", help="goldens folder (default: ./goldens or $TOYHARNESS_GOLDENS)")
    g.add_argument("--mode", default="auto", choices=["auto", "fast", "portable"],
                   help="fast: goldens/<this build's fingerprint>/; portable: goldens/cpu-portable/, run in the "
                        "portable mode (the same bits on every CPU); auto (default): fast where that golden "
                        "exists, else portable")
    g.add_argument("--debug", action="store_true", help=DEBUG_HELP)

    b = sub.add_parser("bench", help="ms/step, items/s (tokens or images), peak RSS, beside PyTorch where a recipe "
                                    "has a PyTorch twin; writes runs/bench-*.json",
                       description="Time each recipe's training step at its bench config (its defaults), each side "
                                   "in its own process. A recipe with a PyTorch twin (its torch_reference) runs "
                                   "beside it, with AdamW, in alternating rounds, where torch is installed; any other "
                                   "runs alone. Reports medians, items/s, peak memory, the speedup (PyTorch ms / "
                                   "toyharness ms), matmul GFLOP/s against this machine's measured FP32 sgemm "
                                   "ceiling, and the host overhead of a step.")
    b.add_argument("recipes", nargs="*", help="default: every installed recipe")
    b.add_argument("--steps", type=int, help="timed steps per side (median; default 20); with --profile, steps "
                                             "timed node by node (median; default 5)")
    b.add_argument("--warmup", type=int, help="untimed steps per side first (default 3)")
    add_shared_flags(b, threads_help="threads for both sides (default: free cores)",
                     progress_help="as in every command; bench draws no progress display to turn off (a row "
                                   "per recipe as each finishes)",
                     out_help="where to write the results (default runs/bench-<fingerprint>[-<size>].json: "
                              "under runs/, which git ignores, one file per build and size)")
    b.add_argument("--torch-device", help="PyTorch device (default: cuda for --backend cuda, else cpu)")
    b.add_argument("--size", default="default", choices=list(SIZES),
                   help="model size: default (each recipe's bench config), nano (n_layer 6, d_model 384, n_head 6, "
                        "t_seq 256, t_batch 64: nanoGPT's shakespeare-char) or gpt2-small (n_layer 12, d_model 768, "
                        "n_head 12, t_seq 1024, t_batch 8); applied before --set; without recipes named, the "
                        "recipes that have those options")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a bench option")
    b.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    b.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "bf16"],
                   help="the matrix products' precision on both sides (cuda): fp32 (default; PyTorch eager with "
                        "TF32 off), tf32 (PyTorch eager with TF32 on), bf16 (PyTorch bf16 autocast with "
                        "torch.compile, and eager: both reported)")
    b.add_argument("--torch-modes", metavar="MODES",
                   help="PyTorch's sides, comma-separated, the first the speedup's: eager, compile (default: eager; "
                        "for bf16 compile,eager)")
    b.add_argument("--profile", action="store_true",
                   help="instead: where a toyharness step's time goes, by ggml op (each node timed alone; "
                        "no PyTorch needed, nothing written)")

    w = sub.add_parser("sweep", help="run a recipe over a grid of options and seeds (local pool or Ray)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=SWEEP_DESCRIPTION)
    w.add_argument("recipe", nargs="?", help="the recipe (not needed with --resume)")
    w.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="an option and its values (repeatable: the grid is every combination); a list-valued "
                        "option separates its values with ';' (targets=q,v;q,k,v)")
    w.add_argument("--seeds", metavar="N|S1,S2",
                   help="N seeds counting up from the options' seed, or a list (default 1: the options' seed)")
    w.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="set one option for every point (repeatable)")
    w.add_argument("--steps", type=int, help="training steps of every point (default: the recipe's)")
    add_shared_flags(w, backend_default=None,
                     backend_help=BACKEND_HELP.replace("(default cpu)", "(default cpu; with --resume, the sweep's)"),
                     threads_help="threads per point (default 1, or cores / workers); workers x threads <= cores",
                     progress_help="no live progress line", out_metavar="DIR",
                     out_help="the sweep's folder (default: sweeps/RECIPE-TIMESTAMP)")
    w.add_argument("--workers", type=int,
                   help="points at a time (default: cores / threads; with --backend cuda: one per GPU, each point "
                        "seeing its worker's GPU alone; with --ray: the cluster's CPUs / threads, and GPUs on cuda)")
    w.add_argument("--ray", metavar="auto|ADDRESS",
                   help="run each point as a Ray task: auto (this machine's cluster), HOST:PORT, ray://HOST:PORT "
                        "or local; needs pip install \"toyharness[ray]\"")
    w.add_argument("--keep-models", action="store_true",
                   help="with --ray: bring model and checkpoint files back too (default: they stay on the worker)")
    w.add_argument("--resume", metavar="DIR",
                   help="continue the sweep in DIR: finished points are kept, interrupted ones go on from their "
                        "checkpoints bit for bit, failed ones run again")
    w.add_argument("--debug", action="store_true", help=DEBUG_HELP + " (errors of the sweep itself; a failed point's "
                   "message is in sweep.json)")
    w.add_argument("--log", action="append", metavar="NAME[,NAME]",
                   help=LOG_HELP + "; the sweep and each of its points (grid values and seed as tags)")
    w.add_argument("--rank", metavar="METRIC[:max]",
                   help="sort the table by the mean over seeds of METRIC's last value: eval_loss (the default), "
                        "loss, accuracy, or a metric the recipe logs (dpo: rewards/margins, eval_rewards/accuracies, "
                        "...); lowest first, or highest with :max")

    f = sub.add_parser("fuse", help="fold a run's LoRA adapters into its base: one GGUF llama.cpp runs",
                       description="Write RUN_DIR's model as one GGUF: for lora, each adapted weight W + (alpha/rank) "
                                   "B A merged in f32 from the dequantized base, stored in the base's own type "
                                   "(requantized by ggml's quantizer) or the type named; every other tensor and all "
                                   "the base's metadata (tokenizer, chat template, architecture keys) carried over; "
                                   "general.name and toyharness.fuse.* name the run. For runs without a base "
                                   "(warm_start, llama, gpt2) the trained model, its matrices in the type named. "
                                   "Exit 1 if the file cannot be written (nothing is left under its name).")
    f.add_argument("run_dir", help="a finished run folder (config.toml and checkpoint.gguf)")
    f.add_argument("--type", dest="dtype", default="same", choices=FUSE_TYPES,
                   help="same (default): each tensor in the base's type; or every matrix in this type (norms stay "
                        "f32). A small adapter can drown in a coarse type's rounding: check with a held-out set "
                        "(docs/finetuning.md, \"Which type\")")
    # fuse merges on the host (numpy and ggml's quantizer), in one pass with nothing to show: no
    # --backend, --threads or --no-progress
    add_shared_flags(f, backend=False, threads=False, progress=False,
                     out_help="the fused file (default RUN_DIR/fused.gguf, or RUN_DIR/fused-TYPE.gguf)")

    s = sub.add_parser("sample", help="generate text from a trained language model",
                       description="Sample text from RUN_DIR's model (checkpoint.gguf; for lora, the base plus the "
                                   "adapters), forward only, through the model's tokenizer (the base's or donor's "
                                   "GGUF, `tokenizer=`, else bytes), with a KV cache (each new token one token's "
                                   "forward; the tokens of the full recompute, --no-cache); stops at end of "
                                   "sequence or of turn. --prompts FILE asks every prompt of a file and writes one "
                                   "JSONL reply a line (prompt, reply, tokens; with the file's expected reply, "
                                   "completion and match), then the exact-match rate.")
    s.add_argument("run_dir", help="a finished run folder of a language model (config.toml and checkpoint.gguf)")
    s.add_argument("--prompt", default="", help="the text to continue (default: empty); with --chat, the user's "
                                                "message")
    s.add_argument("--prompts", metavar="FILE",
                   help="a prompt per line, or JSONL: {\"prompt\": ..., \"completion\": ...} (a pair is asked through "
                        "the chat template where the tokenizer has one, as training renders it) or "
                        "{\"messages\": [...]} (a final assistant turn is the expected reply)")
    s.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message with the tokenizer's chat template; print the reply")
    s.add_argument("--tokens", type=int, default=200, help="new tokens at most (default 200; fewer where the "
                                                              "model ends its sequence or turn)")
    s.add_argument("--temperature", type=float, default=0.8,
                   help="softmax temperature (default 0.8); 0: greedy, the most likely token each time")
    s.add_argument("--top-k", type=int, default=40,
                   help="sample among the K most likely tokens only (default 40; 0: all of them)")
    s.add_argument("--seed", type=int, default=0, help="the sampler's random seed (default 0): the same seed, the "
                                                       "same text")
    s.add_argument("--context", type=int,
                   help="positions the KV cache holds (default: the run's t_seq; longer text slides a window of "
                        "that many tokens, recomputed, as --no-cache does)")
    s.add_argument("--dequantize", action="store_true",
                   help="hold a quantized base as its f32 values while sampling: the same model, faster products, "
                        "4x the base's memory")
    s.add_argument("--no-cache", action="store_true",
                   help="no KV cache: the whole window's forward for each new token (the reference)")
    add_shared_flags(s, progress_help="no progress bar (--prompts)", out_metavar="FILE.jsonl",
                     out_help="with --prompts: write the replies here (default stdout)")

    n = sub.add_parser("new-recipe", help="start a new recipe plugin: an installable package with its test, "
                                          "portable golden and CI workflow",
                       description="Write an installable package for recipe NAME: pyproject.toml with its entry "
                                   "point, the recipe (from a template on the public API, or a copy of an installed "
                                   "recipe, renamed), a test through the toyharness_golden fixture, its portable "
                                   "golden recorded by running it, and .github/workflows/test.yml. Then: "
                                   "pip install -e DIR, and pytest in DIR.")
    n.add_argument("name", help="the new recipe's name: lowercase letters, digits and _ (the package is "
                                "toyharness_NAME)")
    n.add_argument("--from", dest="source", metavar="RECIPE",
                   help="copy this installed recipe's module (or package) and rename it, instead of the template")
    n.add_argument("--out", metavar="DIR", help="the folder to create (default ./NAME); it must not exist")
    return p
