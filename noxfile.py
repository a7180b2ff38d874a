"""nox sessions: `nox -s tests-cpu` is the default suite (what CI and the README run)."""

import nox

nox.options.sessions = ["tests-cpu"]
nox.options.reuse_existing_virtualenvs = True


@nox.session(name="tests-cpu")
def tests_cpu(session):
    session.install("-e", ".[test]")
    session.run("pytest", "-q", *session.posargs)


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


@nox.session
def bench(session):
    """ms/step, items/s and peak RSS per recipe at its default config; writes bench.json."""
    session.install("-e", ".[test]")
    session.install("torch==2.13.0")  # the PyTorch eager side; the CPU build
    session.run("toyharness", "bench", *session.posargs)


@nox.session
def lint(session):
    session.install("ruff")
    session.run("ruff", "check", "toyharness", "plugins", "tests", "native", "noxfile.py", "setup.py")


@nox.session
def parity(session):
    """First losses of every recipe against the PyTorch reference (toyharness/reference.py)."""
    session.install("-e", ".[test]")
    session.install("torch==2.13.0")  # the CPU build; never another version
    session.run("pytest", "-q", "-m", "parity", "-rs", *session.posargs)


@nox.session
def llamacpp(session):
    """llama.cpp from the pinned archive loads our exports (and adapters) and gives our logits; its
    tokenizer gives the ids tests/data/tokenizer_agreement.json holds (and ours)."""
    session.install("-e", ".[test]")
    tool = session.run("python", "native/build.py", "--llamacpp-tool", silent=True).strip().splitlines()[-1]
    session.env["TOYHARNESS_LLAMACPP_TOOL"] = tool
    session.run("pytest", "-q", "-m", "llamacpp", "-rs", *session.posargs)


@nox.session(name="tests-metal")
def tests_metal(session):
    """metal tests (macOS); they skip, saying why, where metal is not built or present."""
    session.install("-e", ".[test]")
    session.run("pytest", "-q", "-m", "metal", "-rs", *session.posargs)
