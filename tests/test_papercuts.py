"""What a new user meets first: a resume that goes on where the run ran, a golden check whose
output is the goldens that exist, the flags every command shares, and a typo'd flag answered by
its own command with the flag it meant."""

import argparse
import json
import shutil
from pathlib import Path

import pytest
from helpers import cli

from toyharness import goldens
from toyharness._ffi import available_native_backends
from toyharness.bench import profile as bench_profile
from toyharness.cli import BACKENDS, build_parser, main
from toyharness.discovery import discover
from toyharness.engine import get_engine
from toyharness.engine.backend import PORTABLE_FINGERPRINT

ROOT = Path(__file__).resolve().parent.parent / "goldens"
STEPS = 16    # many enough that the portable mode's rounding shows (its first steps can round as the fast path's)
TINY = ["--set", "n_layer=1", "--set", "d_model=32", "--set", "n_head=2", "--set", "t_seq=24", "--set", "t_batch=2",
        "--set", "eval_every=2", "--set", "checkpoint_every=2", "--set", "warmup=1"]


def loss_bits(run: Path) -> list[str]:
    return [json.loads(line)["loss_hex"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def edit_config(run: Path, **values) -> None:
    """Rewrite keys of a run folder's config.toml (the folder's other files untouched)."""
    import tomli_w
    import tomllib

    doc = tomllib.loads((run / "config.toml").read_text())
    doc.update(values)
    (run / "config.toml").write_text(tomli_w.dumps(doc))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """gpt2 for STEPS steps uninterrupted, and the same run stopped at its step-2 checkpoint (a copy
    of it per test: a resume writes into its folder), all on 1 thread."""
    root = tmp_path_factory.mktemp("runs")
    full, part = root / "full", root / "part"
    for out, steps in ((full, STEPS), (part, 2)):
        res = cli("run", "gpt2", "--steps", steps, *TINY, "--threads", 1, "--out", out, "--no-progress")
        assert res.returncode == 0, res.stderr
    return full, part


@pytest.fixture
def stopped(runs, tmp_path):
    run = tmp_path / "stopped"
    shutil.copytree(runs[1], run)
    return run


# --- 1. --resume goes on where the run ran ---------------------------------------------------------
def test_a_plain_resume_says_nothing_and_a_thread_change_says_the_bits_stay(runs, stopped, tmp_path):
    full, _ = runs
    plain = tmp_path / "plain"
    shutil.copytree(stopped, plain)
    res = cli("run", "gpt2", "--steps", STEPS, "--resume", plain, "--no-progress")
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    assert loss_bits(plain) == loss_bits(full)

    res = cli("run", "gpt2", "--steps", STEPS, "--resume", stopped, "--threads", 2, "--no-progress")
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines() == [f"toyharness: resuming {stopped} at step 2 with threads 1 -> 2: the same bits "
                                       "(the thread count changes no result on any backend)"]
    assert loss_bits(stopped) == loss_bits(full), "the line said the same bits"


def test_a_portable_mode_switch_on_resume_says_the_bits_change(runs, stopped):
    """Fast path to the portable mode, both on the cpu: a real change of bits, said before it happens."""
    full, _ = runs
    res = cli("run", "gpt2", "--steps", STEPS, "--resume", stopped, "--set", "portable=true", "--no-progress")
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines() == [
        f"toyharness: resuming {stopped} at step 2 with portable false -> true: from here the bits need not be the "
        "uninterrupted run's (the portable mode and the fast path sum in other orders)"]
    resumed, uninterrupted = loss_bits(stopped), loss_bits(full)
    assert resumed[:2] == uninterrupted[:2] and resumed[2:] != uninterrupted[2:], "the line said other bits"


@pytest.mark.skipif("cuda" in available_native_backends(), reason="this build has cuda: a run recorded on cuda "
                    "would resume there, which is what this test checks the refusal of on a build without it")
def test_resume_goes_on_on_the_runs_backend_not_the_cpu(stopped):
    """A run on cuda at bf16, resumed on a cpu-only build without --backend, was refused for its
    precision as if the user had asked for the cpu. The run folder here is a cpu run whose
    config.toml is edited to say cuda and bf16: what the resume reads to choose its backend."""
    edit_config(stopped, backend="cuda", precision="bf16", fingerprint="cuda-sm90")
    res = cli("run", "gpt2", "--steps", STEPS, "--resume", stopped, "--no-progress")
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == [
        f"toyharness: error: --resume {stopped}: the run ran on the cuda backend: backend 'cuda' is not in this build "
        "(built: cpu); rebuild with TOYHARNESS_BACKENDS=cpu,cuda pip install -e .; to go on elsewhere, name a backend "
        "with --backend (not bit for bit)"]


def test_another_backend_named_on_resume_says_what_changed_and_that_the_bits_do(runs, stopped):
    """The command line names the cpu for a run whose config.toml says cuda at bf16 (edited, as
    above): the precision the cpu lacks is refused with what to pass, then the change is one line."""
    edit_config(stopped, backend="cuda", precision="bf16", fingerprint="cuda-sm90")
    before = {p.name: p.read_bytes() for p in stopped.iterdir()}
    res = cli("run", "gpt2", "--steps", STEPS, "--resume", stopped, "--backend", "cpu", "--no-progress")
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == [
        f"toyharness: error: --resume {stopped}: the run computed its products in bf16 on cuda, which the cpu backend "
        "does not; add --set precision=fp32 (not bit for bit)"]
    assert {p.name: p.read_bytes() for p in stopped.iterdir()} == before

    res = cli("run", "gpt2", "--steps", STEPS, "--resume", stopped, "--backend", "cpu", "--set", "precision=fp32",
              "--no-progress")
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines() == [
        f"toyharness: resuming {stopped} at step 2 with backend cuda -> cpu, precision bf16 -> fp32: from here the "
        "bits need not be the uninterrupted run's (another backend's kernels round otherwise; another precision "
        "rounds the matrix products otherwise)"]
    assert len(loss_bits(stopped)) == STEPS


def test_a_resume_on_another_fingerprint_says_the_bits_may_change(runs, stopped):
    """The same backend and mode on another build or CPU (config.toml edited to name another
    fingerprint): nothing on the command line changed, but the bits may."""
    fingerprint = get_engine("cpu").fast_fingerprint()
    edit_config(stopped, fingerprint="cpu-scalar")
    res = cli("run", "gpt2", "--steps", STEPS, "--resume", stopped, "--no-progress")
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines() == [
        f"toyharness: resuming {stopped} at step 2 with fingerprint cpu-scalar -> {fingerprint}: from here the bits "
        "need not be the uninterrupted run's (another build or device computes other bits)"]
    assert loss_bits(stopped) == loss_bits(runs[0]), "this machine's build made both"


def test_config_with_resume_is_refused_by_name(stopped):
    """--config beside --resume was dropped without a word: the run's own config.toml won."""
    res = cli("run", "gpt2", "--resume", stopped, "--config", stopped / "config.toml", "--steps", 4)
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == [
        f"toyharness: error: --config with --resume {stopped}: a resumed run takes its options from "
        f"{stopped / 'config.toml'}; change one with --set KEY=VALUE"]


# --- 2. golden check: a line per golden that exists, one for the rest --------------------------------
@pytest.fixture
def one_golden(tmp_path):
    """A goldens folder holding gpt2's golden only (the one a check on this machine uses)."""
    path, _ = goldens.resolve("gpt2", root=ROOT)
    if not path.is_file():
        pytest.skip(f"no gpt2 golden at {path}; record with `toyharness golden record gpt2`")
    dest = tmp_path / path.parent.name / path.name
    dest.parent.mkdir()
    shutil.copy(path, dest)
    names = [name for recipe in discover() for name in goldens.golden_names(recipe)]
    return tmp_path, dest, [n for n in names if n != "gpt2"]


def test_golden_check_summarises_the_variants_with_no_golden_in_one_line(one_golden, capsys):
    root, dest, others = one_golden
    fast = get_engine("cpu").fast_fingerprint()
    threads = get_engine("cpu").threads
    try:
        assert main(["golden", "check", "--dir", str(root), "--threads", "1"]) == 0
        assert get_engine("cpu").threads == 1, "--threads reaches the golden runs' engine"
    finally:
        get_engine("cpu", threads)
    assert capsys.readouterr().out.splitlines() == [
        f"ok   gpt2 ({goldens.describe(dest)})",
        f"{len(others)} recipe variants with no golden for {fast} nor {PORTABLE_FINGERPRINT}: not checked; "
        "--verbose lists them"]


def test_golden_check_verbose_lists_them_one_per_line(one_golden, capsys):
    root, dest, others = one_golden
    fast = get_engine("cpu").fast_fingerprint()
    assert main(["golden", "check", "--dir", str(root), "--verbose"]) == 0
    names = [name for recipe in discover() for name in goldens.golden_names(recipe)]
    assert capsys.readouterr().out.splitlines() == [
        f"ok   gpt2 ({goldens.describe(dest)})" if name == "gpt2" else
        f"SKIP {name}: no golden for {name} at {root / PORTABLE_FINGERPRINT / name}.yml (nor one for {fast}); "
        f"record one with `toyharness golden record {name} --mode portable --dir {root}`" for name in names] + [
        f"{len(others)} recipe variants with no golden for {fast} nor {PORTABLE_FINGERPRINT}: not checked "
        "(listed above)"]


def test_golden_record_refuses_verbose(capsys):
    assert main(["golden", "record", "gpt2", "--verbose"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "toyharness: error: --verbose: lists the variants a check finds no golden for; record writes every one"]


# --- 3. the flags every command shares -------------------------------------------------------------
SHARED = ("--backend", "--threads", "--no-progress", "--out")


def test_every_command_takes_the_shared_flags_where_they_mean_something():
    """recipes computes nothing; fuse merges on the host in one pass (no backend, threads or
    progress display); golden's folder is --dir, read and written, not an output --out."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    taken = {name: {flag: a for a in parser._actions for flag in a.option_strings if flag in SHARED}
             for name, parser in sub.choices.items()}
    assert {name: sorted(flags) for name, flags in taken.items()} == {
        "recipes": [],
        "run": sorted(SHARED), "bench": sorted(SHARED), "sweep": sorted(SHARED), "sample": sorted(SHARED),
        "golden": ["--backend", "--no-progress", "--threads"],
        "fuse": ["--out"], "new-recipe": ["--out"]}
    for flags in taken.values():     # and they mean one thing: the same kind of value everywhere
        if "--backend" in flags:
            assert tuple(flags["--backend"].choices) == BACKENDS
        if "--threads" in flags:
            assert flags["--threads"].type is int
        if "--no-progress" in flags:
            assert isinstance(flags["--no-progress"], argparse._StoreTrueAction)


def test_bench_profile_takes_the_step_count_and_no_progress(monkeypatch, capsys):
    """bench refused --no-progress, and refused --profile --steps 5 ("not used by --profile")."""
    seen = []
    real = bench_profile.profile_recipe

    def spy(*args, **kwargs):
        seen.append(kwargs.get("repeats"))
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_profile, "profile_recipe", spy)
    sets = [arg for arg in TINY if arg != "--set"]
    assert main(["bench", "gpt2", "--profile", "--steps", "3", "--no-progress", "--threads", "1",
                 *[x for s in sets for x in ("--set", s)]]) == 0
    assert seen == [3], "the step count reached the profile"
    assert capsys.readouterr().out.startswith("gpt2: cpu, 1 threads")
    assert main(["bench", "gpt2", "--profile", "--steps", "0"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "toyharness: error: --steps 0: --profile times at least 1 step node by node"]


# --- 4. a typo'd flag: that command's usage, and the flag it meant ----------------------------------
def usage_of(command: str) -> str:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command].format_usage()


@pytest.mark.parametrize("args,command,message", [
    (["run", "gpt2", "--stpes", "5"], "run", "unknown flag --stpes for toyharness run; did you mean --steps?"),
    (["bench", "--no-progess"], "bench",
     "unknown flag --no-progess for toyharness bench; did you mean --no-progress?"),
    (["sample", "RUN", "--tokns", "3", "--tempreature", "0"], "sample",
     "unknown flags --tokns, --tempreature for toyharness sample; did you mean --tokens for --tokns, --temperature "
     "for --tempreature?"),
    (["golden", "check", "--bogus"], "golden",
     "unknown flag --bogus for toyharness golden (`toyharness golden --help` lists its flags)"),
])
def test_an_unknown_flag_gets_its_commands_usage_and_a_guess(args, command, message, capsys):
    """`toyharness run gpt2 --stpes 5` printed the top level's usage ("usage: toyharness [-h]
    {recipes,run,...}") and "unrecognized arguments: --stpes 5"."""
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == usage_of(command) + f"toyharness: error: {message}\n"
