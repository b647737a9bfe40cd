"""Helpers for the setup, exec and pull tests: a wheel built here (the test
containers have no PyPI), and small trainers."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def build_wheel(folder: Path, name: str, version: str, module_text: str) -> Path:
    """A pure-Python wheel of `name` with one module `name` (dashes as underscores),
    written by hand: what pip installs from a --find-links folder."""
    module = name.replace("-", "_")
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{module}-{version}"
    wheel = folder / f"{dist}-py3-none-any.whl"
    files = {
        f"{module}/__init__.py": module_text,
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
        f"{dist}.dist-info/top_level.txt": f"{module}\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{dist}.dist-info/RECORD,,")
    files[f"{dist}.dist-info/RECORD"] = "\n".join(record) + "\n"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


# Imports the package the setup installed, says where it runs from, waits for SIGTERM.
IMPORTING_TRAINER = """\
import os, signal, sys, time
import hello_pkg
import yaml  # from container.python's own packages: the venv reuses them
print("hello", hello_pkg.VALUE, "prefix", sys.prefix, flush=True)
print("path", os.environ.get("PATH", ""), flush=True)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
time.sleep(60)
"""

# Writes two checkpoints (with a drafter/ export) and metrics, like the bundled trainer.
CHECKPOINT_TRAINER = """\
import json, os, sys
run = os.environ["DFLASH_RUN_DIR"]
base = os.path.join(run, "outputs", "checkpoints")
for step in (1, 2):
    folder = os.path.join(base, "step-%06d" % step)
    os.makedirs(os.path.join(folder, "drafter"), exist_ok=True)
    with open(os.path.join(folder, "state.pt"), "wb") as f:
        f.write(os.urandom(300000 + step))
    with open(os.path.join(folder, "drafter", "config.json"), "w") as f:
        json.dump({"step": step, "dtype": "bfloat16"}, f)
    with open(os.path.join(folder, "drafter", "model.safetensors"), "wb") as f:
        f.write(os.urandom(200000))
    with open(os.path.join(base, "latest"), "w") as f:
        f.write("step-%06d\\n" % step)
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": step, "loss": 1.0 / step}) + "\\n")
print("done", flush=True)
"""
